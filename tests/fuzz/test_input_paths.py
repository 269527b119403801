"""Hostile records on each tier's input topic, with the real broker: dead letters, no crash.

For the rollout worker (``prompts``), the reward worker (``episodes``) and the grouping consumer
(``scored``), in-process: a derandomized hypothesis sample of random and broken byte strings plus
hand-written cases (wrong schema version, unknown kind, group sizes out of range, a task id reused
with another group size, tokens/logprobs length mismatch, NaN/+inf logprobs, a non-finite reward,
an unknown or import-path workflow, a tombstone, a record bigger than the tier's
``kafka.max_message_bytes``). Each must end in the dead-letter topic with its reason, the tier
must keep running, and a good record sent after all of them must still come out.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.configs import make_config
from harness.episodes import claiming
from harness.ledger import read_topic
from harness.strategies import BUDGET, as_dict, broken_bytes, episode, float_tensor, raw, trajectory, valid_messages
from rollstream.api.engine import WeightUpdate
from rollstream.config import RollstreamConfig
from rollstream.consumers.grouping.service import run as run_grouping
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.state.client import RedisKeys
from rollstream.state.version_store import VersionStore
from rollstream.reward_workers.service import run as run_reward_worker
from rollstream.rollout_workers.service import run as run_rollout_worker
from rollstream.wire import (
    EmittedGroup,
    Episode,
    GroupDropped,
    PromptTask,
    SampleRejected,
    ScoredEpisode,
    TaskFailed,
    WireDecodeError,
    decode_dead_letter,
    decode_episode,
    decode_group,
    decode_prompt,
    decode_scored,
    encode,
)
from rollstream.wire.messages import SCHEMA_VERSION
from rollstream.wire.torch_tensors import encode_tensor_dict


pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]

TIER_MAX_BYTES = 1024 * 1024  # the tier's kafka.max_message_bytes
TOPIC_MAX_BYTES = 4 * 1024 * 1024  # what the topics (created by the test) accept
OVERSIZE = b"\xc1" * (TIER_MAX_BYTES + 4096)  # 0xc1 is never valid MessagePack
NOT_ALLOWED = "tests.fuzz.not_allowed"

Case = tuple[str, bytes | None, str]  # key, value, a piece of the expected dead-letter reason


def random_cases(valid: bytes, prefix: str, decode: Callable[[bytes], Any]) -> list[Case]:
    """A fixed, derandomized hypothesis sample of broken and random byte strings.

    Only those the decoder refuses are kept (a flipped bit inside a string can leave a valid
    message, which is no longer hostile input), each expecting exactly the decoder's reason.
    """
    found: list[bytes] = []

    @settings(**{**BUDGET, "max_examples": 15})
    @given(st.one_of(broken_bytes(valid), st.binary(max_size=64)))
    def collect(blob: bytes) -> None:
        found.append(blob)

    collect()
    cases: list[Case] = []
    for blob in dict.fromkeys(found):
        try:
            decode(blob)
        except WireDecodeError as exc:
            cases.append((f"{prefix}-fuzz-{len(cases)}", blob, exc.reason))
    return cases


def configs(kafka_bootstrap: str, redis_url: str, name: str, sections: dict[str, Any]) -> tuple[RollstreamConfig, RollstreamConfig]:
    """(the test's config, the tier's config): same topics, the tier with a smaller size limit."""
    mine = make_config(kafka_bootstrap, redis_url, name, {"kafka": {"max_message_bytes": TOPIC_MAX_BYTES}})
    tier = make_config(kafka_bootstrap, redis_url, name, {"kafka": {"max_message_bytes": TIER_MAX_BYTES}, **sections})
    return mine, tier



async def send(config: RollstreamConfig, topic: str, records: list[tuple[str, bytes | None]]) -> None:
    """In order, all to partition 0: every good record sent last sits BEHIND the hostile ones."""
    producer = make_producer(config.kafka, "fuzz-sender")
    await producer.start()
    try:
        for key, value in records:
            await producer.send(topic, value, key=key.encode(), partition=0)
        await producer.flush()
    finally:
        await producer.stop()


async def feed_and_check(
    config: RollstreamConfig, tier_config: RollstreamConfig, topic: str, cases: list[Case],
    good: tuple[str, bytes], tier: Callable[[RollstreamConfig, asyncio.Event], Awaitable[None]],
    output_topic: str, came_out: Callable[[Any], bool], decode_output: Callable[[bytes], Any],
) -> dict[str, str]:
    """Send ``cases`` then ``good``; run the tier until the good record's output and every dead
    letter are there; return the dead-letter reasons by key."""
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    await send(config, topic, [(key, value) for key, value, _ in cases] + [good])
    stop = asyncio.Event()
    task = asyncio.create_task(tier(tier_config, stop))
    deadline = time.monotonic() + 90
    reasons: dict[str, str] = {}
    try:
        while True:
            assert not task.done(), f"the tier stopped: {task.exception() if not task.cancelled() else 'cancelled'}"
            letters = await read_topic(config.kafka, names.dead_letter, decode_dead_letter)
            reasons = {(letter.key or b"").decode(): letter.reason for letter in letters}
            outputs = await read_topic(config.kafka, output_topic, decode_output)
            if any(came_out(m) for m in outputs) and all(key in reasons for key, _, _ in cases):
                break
            assert time.monotonic() < deadline, (
                f"missing dead letters {[k for k, _, _ in cases if k not in reasons]} or the good output"
            )
            await asyncio.sleep(0.5)
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    for key, _, expected in cases:
        assert expected in reasons[key], (key, expected, reasons[key])
    return reasons


def prompt_cases() -> list[Case]:
    valid = valid_messages()["prompt"]
    fields = as_dict(valid)
    return [
        ("p-truncated", valid[:-3], "undecodable"),
        ("p-version", raw(fields | {"schema_version": 99}), "unsupported schema_version 99"),
        ("p-kind", valid_messages()["episode"], "schema validation failed"),
        ("p-unknown-kind", raw(fields | {"kind": "launch_missiles"}), "schema validation failed"),
        ("p-negative-group", raw(fields | {"group_size": -4}), "Expected `int` >= 1 - at `$.group_size`"),
        ("p-huge-group", raw(fields | {"group_size": 10**9}), "Expected `int` <= 1024 - at `$.group_size`"),
        ("p-unknown-workflow", raw(fields | {"workflow": "no-such-key"}), "workflow 'no-such-key' is not allowed"),
        ("p-import-path", raw(fields | {"workflow": f"{NOT_ALLOWED}:Evil"}), "is not allowed"),
        ("p-import-dotted", raw(fields | {"workflow": f"{NOT_ALLOWED}.Evil"}), "is not allowed"),
        ("p-tombstone", None, "tombstone"),
        ("p-oversize", OVERSIZE, "undecodable"),
        *random_cases(valid, "p", decode_prompt),
    ]


async def test_rollout_worker_input(kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model: Path) -> None:
    config, tier = configs(kafka_bootstrap, redis_url, unique_name, {"rollout": {
        "model_path": str(tiny_model), "seed": 0, "worker_id": "w-fuzz", "gconfig": {"max_new_tokens": 2},
        "commit_interval_seconds": 0.2,
    }})
    names = TopicNames.of(config)
    good = PromptTask(task_id="good", group_size=1, data={"prompt": "What is 1+1?"})
    cases = prompt_cases()
    await feed_and_check(
        config, tier, names.prompts, cases, ("good", encode(good)), run_rollout_worker, names.episodes,
        lambda m: isinstance(m, Episode) and m.task_id == "good", decode_episode,
    )
    assert NOT_ALLOWED not in sys.modules, "a message made the worker import a module"
    # every refused prompt is answered on episodes, so its group ends downstream: by the record
    # key when the value is undecodable, by the message's task id (here "t-1") otherwise
    failed = {m.task_id for m in await read_topic(config.kafka, names.episodes, decode_episode)
              if isinstance(m, TaskFailed)}
    undecodable = {key for key, value, _ in cases if not _decodes(decode_prompt, value)}
    assert undecodable <= failed and "t-1" in failed, failed


def _decodes(decode: Callable[[bytes | None], Any], value: bytes | None) -> bool:
    try:
        decode(value)
    except WireDecodeError:
        return False
    return True


def with_extra_shape(message: dict[str, Any], shape: list[int]) -> dict[str, Any]:
    """``message`` (an episode as a dict) with an empty float32 tensor of ``shape`` added."""
    return message | {"trajectory": message["trajectory"] | {"extra": ["float32", shape, b""]}}


def shape_cases(prefix: str, fields: dict[str, Any], wrap: Callable[[dict[str, Any]], dict[str, Any]]) -> list[Case]:
    """Empty tensors whose declared shape would break whatever computes with them later."""
    return [
        (f"{prefix}-shape-2-63", raw(wrap(with_extra_shape(fields, [0, 2**63]))), "<= 2147483647"),
        (f"{prefix}-shape-wide", raw(wrap(with_extra_shape(fields, [0, 2**31 - 1]))), "declares more than"),
        (f"{prefix}-shape-rank", raw(wrap(with_extra_shape(fields, [0] * 9))), "length <= 8"),
    ]


def episode_cases() -> list[Case]:
    valid = valid_messages()["episode"]
    fields = as_dict(valid)
    ep = episode()

    def with_logprobs(values: list[float]) -> bytes:
        return encode(msgspec.structs.replace(ep, trajectory={**ep.trajectory, "logprobs": float_tensor(values)}))

    return [
        ("e-truncated", valid[: len(valid) // 2], "undecodable"),
        ("e-version", raw(fields | {"schema_version": SCHEMA_VERSION + 1}), f"unsupported schema_version {SCHEMA_VERSION + 1}"),
        ("e-kind", valid_messages()["prompt"], "schema validation failed"),
        ("e-negative-group", raw(fields | {"group_size": -1}), "Expected `int` >= 1 - at `$.group_size`"),
        ("e-huge-group", raw(fields | {"group_size": 2**40}), "<= 1024 - at `$.group_size`"),
        ("e-sample-idx", raw(fields | {"sample_idx": 7}), "sample_idx 7 outside"),
        ("e-length-mismatch", with_logprobs([0.0, 0.0, -0.5]), "shape"),
        ("e-nan", with_logprobs([0.0, 0.0, float("nan"), -0.5, -0.5]), "NaN"),
        ("e-inf", with_logprobs([0.0, 0.0, float("inf"), -0.5, -0.5]), "infinity"),
        ("e-tombstone", None, "tombstone"),
        ("e-oversize", OVERSIZE, "undecodable"),
        *shape_cases("e", fields, lambda episode: episode),
        *random_cases(valid, "e", decode_episode),
    ]


async def test_reward_worker_input(kafka_bootstrap: str, redis_url: str, unique_name: str) -> None:
    config, tier = configs(kafka_bootstrap, redis_url, unique_name, {"reward": {
        "worker_id": "w-fuzz", "session_timeout_ms": 6000, "max_workers": 1, "timeout_seconds": 10,
    }})
    names = TopicNames.of(config)
    # a message cannot choose the reward function either: this is just data for the configured one
    good = episode(task_id="good", sample_idx=0, group_size=1)
    good = msgspec.structs.replace(good, data={**good.data, "reward_fn": f"{NOT_ALLOWED}:evil_reward"})
    await feed_and_check(
        config, tier, names.episodes, episode_cases(), ("good", encode(good)), run_reward_worker, names.scored,
        lambda m: isinstance(m, ScoredEpisode) and m.episode.task_id == "good", decode_scored,
    )
    assert NOT_ALLOWED not in sys.modules


def scored_cases() -> list[Case]:
    valid = valid_messages()["scored"]
    fields = as_dict(valid)
    return [
        ("s-truncated", valid[:10], "undecodable"),
        ("s-version", raw(fields | {"schema_version": 7}), "unsupported schema_version 7"),
        ("s-kind", valid_messages()["episode"], "schema validation failed"),
        ("s-nan-reward", raw(fields | {"reward": float("nan")}), "not finite"),
        ("s-inf-reward", raw(fields | {"reward": float("inf")}), "not finite"),
        ("s-negative-group", raw(fields | {"episode": fields["episode"] | {"group_size": -2}}), "at `$.episode.group_size`"),
        ("s-tombstone", None, "tombstone"),
        ("s-oversize", OVERSIZE, "undecodable"),
        *shape_cases("s", fields["episode"], lambda episode: fields | {"episode": episode}),
        *random_cases(valid, "s", decode_scored),
    ]


def version_cases() -> list[Case]:
    """Episodes whose versions cannot be true (the trainer is at version 3): refused at intake."""
    return [
        ("v-negative", encode(claiming("v-negative", 0, [3, -7, 3], 3, 3, group_size=1)), "token version -7 is below -1"),
        ("v-outside", encode(claiming("v-outside", 0, [2, 3], 3, 3, group_size=1)), "outside the head_version"),
        ("v-no-span", encode(claiming("v-no-span", 0, [3], 3, 1, group_size=1)), "are not a span"),
        ("v-ahead", encode(claiming("v-ahead", 0, [9], 9, 9, group_size=1)), "above the trainer's current version 3"),
    ]


async def test_grouping_input(kafka_bootstrap: str, redis_url: str, unique_name: str, redis_client: Any) -> None:
    config, tier = configs(kafka_bootstrap, redis_url, unique_name, {"grouping": {
        "instance_id": "g-fuzz", "session_timeout_ms": 6000, "commit_interval_ms": 100,
    }})
    names = TopicNames.of(config)
    cases = scored_cases() + version_cases()
    await VersionStore(redis_client, RedisKeys(unique_name, "t0")).publish(WeightUpdate(3, "/weights/3"))
    # the same task id, first with group size 2, then with 3: the second contradicts the open group
    first = SampleRejected(task_id="reused", sample_idx=0, group_size=2)
    second = SampleRejected(task_id="reused", sample_idx=1, group_size=3)
    # a group whose samples each decode but cannot be padded together (ranks 2 and 3)
    ranks = [ScoredEpisode(episode=msgspec.structs.replace(
        episode(task_id="ranks", sample_idx=i, group_size=2),
        trajectory=encode_tensor_dict({**trajectory(), "x": torch.zeros([1] * (2 + i))})), reward=1.0) for i in range(2)]
    await ensure_topics(config.kafka, names)
    await send(config, names.scored, [("reused", encode(first)), ("ranks", encode(ranks[0]))])
    reused: Case = ("reused", encode(second), "group_size 3 differs from the open group's 2")
    ranked: Case = ("ranks", encode(ranks[1]), "group cannot be emitted: ValueError: cannot concatenate 'x'")
    good = ScoredEpisode(episode=episode(task_id="good", sample_idx=0, group_size=1), reward=1.0)
    reasons = await feed_and_check(
        config, tier, names.scored, cases + [reused, ranked], ("good", encode(good)), run_grouping, names.batches,
        lambda m: isinstance(m, EmittedGroup) and m.task_id == "good", decode_group,
    )
    assert "differs" in reasons["reused"]
    ended = {m.task_id: m.reason for m in await read_topic(config.kafka, names.batches, decode_group)
             if isinstance(m, GroupDropped)}
    assert ended["ranks"] == "dead_lettered"
    emitted = emitted_tasks(await read_topic(config.kafka, names.batches, decode_group))
    assert not emitted & {task_id for task_id, _, _ in version_cases()}, emitted
    assert {ended[task_id] for task_id, _, _ in version_cases()} == {"all_failed"}, ended


def emitted_tasks(records: list[Any]) -> set[str]:
    return {m.task_id for m in records if isinstance(m, EmittedGroup)}

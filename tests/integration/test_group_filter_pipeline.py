"""Half the groups filtered, and the trainer's steps stay full (real broker and Redis).

producer -> rollout worker (a scripted engine, so the test is about groups, not the model) ->
reward worker -> grouping with an AReaL-style group filter (``traj["rewards"].std() > 0``,
named by import string in ``grouping.group_filters``) -> ``rollstream.trainer.StepStream``,
playing a trainer that commits each step and publishes a new weight version. Every other prompt
gives all its samples the same reward. The staleness budget admits one step of prompts per
version (``max_head_offpolicyness: 0``), so the steps fill only because each filtered group
returns its slot and the producer admits a prompt in its place.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from harness.configs import make_config
from harness.ledger import read_topic
from harness.waits import stop_in_process_tiers
from rollstream.config import RollstreamConfig
from rollstream.consumers.grouping import service as grouping_service
from rollstream.kafka.topics import TopicNames
from rollstream.producers import service as producer_service
from rollstream.reward_workers import service as reward_service
from rollstream.rollout_workers import service as rollout_service
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys, connect
from rollstream.trainer import StepStream, VersionPublisher
from rollstream.wire import EmittedGroup, GroupDropped, decode_group, decode_prompt


pytestmark = [pytest.mark.broker, pytest.mark.timeout(300)]

STEP = 4  # groups per step = prompts admitted per version
STEPS = 3
PROMPTS = 48  # every other one constant: enough varied prompts for the steps


def _config(kafka: str, redis_url: str, name: str, tokenizer: Path, dataset: Path) -> RollstreamConfig:
    return make_config(kafka, redis_url, name, {
        "staleness": {"max_head_offpolicyness": 0, "groups_per_step": STEP},
        "producer": {"dataset": str(dataset), "group_size": 4, "batch_linger_ms": 20},
        "rollout": {"engine": "custom", "engine_factory": "tests.integration.group_filter_parts:make_engine",
                    "tokenizer_path": str(tokenizer), "seed": 0, "worker_id": "rw", "max_concurrent_rollouts": 16,
                    "commit_interval_seconds": 0.2},
        "reward": {"reward_fn": "tests.integration.group_filter_parts:coin_reward", "worker_id": "rew",
                   "max_workers": 1, "session_timeout_ms": 6000},
        "grouping": {"instance_id": "g", "commit_interval_ms": 50, "session_timeout_ms": 6000,
                     "group_filters": ["tests.unit.group_filter_fns:varied_rewards"]},
        "trainer": {"group_id": f"{name}-trainer", "checkpoint_dir": str(dataset.parent / "ckpt")},
    })


async def _train(config: RollstreamConfig, weights: Path, tiers: list[asyncio.Task[None]]) -> list[list[str]]:
    """``STEPS`` steps as a trainer takes them: each committed, then a new version published."""
    steps: list[list[str]] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 150
    async with StepStream(config) as batches, VersionPublisher(config) as versions:
        while len(steps) < STEPS:
            assert loop.time() < deadline, f"only {len(steps)} of {STEPS} steps arrived"
            for tier in tiers:
                if tier.done():
                    raise AssertionError(f"a tier stopped: {tier.exception()!r}")
            batch = await batches.next_step(timeout=2)
            if batch is None:
                continue
            steps.append(list(batch.task_ids))
            await batches.commit(batch)
            await versions.publish(batch.step, weights)
    return steps


async def _run(config: RollstreamConfig, weights: Path) -> list[list[str]]:
    stop = asyncio.Event()
    runs: list[Callable[[RollstreamConfig, asyncio.Event], Awaitable[None]]] = [
        grouping_service.run, reward_service.run, rollout_service.run, producer_service.run]
    tiers = [asyncio.create_task(run(config, stop)) for run in runs]
    try:
        return await _train(config, weights, tiers)
    finally:
        await stop_in_process_tiers(tiers, stop)


async def test_steps_stay_full_while_half_the_groups_are_filtered(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model_dir: Path, tmp_path: Path,
) -> None:
    dataset = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"What is {i % 7}+{i % 5}?", "answer": str(i % 7 + i % 5), "constant": i % 2 == 0}
            for i in range(PROMPTS)]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _config(kafka_bootstrap, redis_url, unique_name, tiny_model_dir, dataset)

    steps = await _run(config, tiny_model_dir)

    names = TopicNames.of(config)
    constant = {p.task_id: bool(p.data["constant"]) for p in await read_topic(config.kafka, names.prompts, decode_prompt)}
    assert [len(step) for step in steps] == [STEP] * STEPS, "every step is full"
    trained = [task for step in steps for task in step]
    assert not any(constant[task] for task in trained), "no zero-variance group is trained on"
    ended = await read_topic(config.kafka, names.batches, decode_group)
    emitted = [m.task_id for m in ended if isinstance(m, EmittedGroup)]
    dropped = {m.task_id: m for m in ended if isinstance(m, GroupDropped)}
    assert set(trained) <= set(emitted) and not set(emitted) & set(dropped), "each group ends once"
    assert {d.reason for d in dropped.values()} == {"filtered"}
    assert all(constant[task] for task in dropped) and len(dropped) >= STEP * STEPS - STEP, \
        f"half the groups filtered: {len(dropped)} drops for {len(emitted)} batches"
    assert all("varied_rewards refused it (rewards [0.5, 0.5, 0.5, 0.5])" in d.detail for d in dropped.values())
    redis = connect(config.redis)
    try:  # counted, and each filtered group returned its slot
        assert await StalenessBudget(redis, RedisKeys(names.experiment, names.trial), 0, STEP).drops_by_reason() == {
            "filtered": len(dropped)}
    finally:
        await redis.aclose()

"""The rollout worker against the real broker and Redis, with a tiny local transformers model.

In-process: prompts in, one message per sample out, garbage dead-lettered, offsets committed;
weight versions followed mid-generation. As subprocesses: a SIGKILLed worker's unfinished
prompts are re-run by the next one, and SIGTERM exits 0 after committing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import yaml
from aiokafka.structs import TopicPartition

from harness.configs import make_config
from harness.full_length import FULL_LENGTH_RLVR, GATE, GATED_FULL_LENGTH_RLVR, close_gate
from harness.rollout_feed import TopicReader, publish_prompts, stop_worker
from harness.tiers import TierProcess
from rollstream.api.engine import WeightUpdate
from rollstream.config import RollstreamConfig
from rollstream.dev.redis_server import LocalRedisServer
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_admin, make_consumer
from rollstream.rollout_workers.service import run
from rollstream.state.client import RedisKeys, connect
from rollstream.state.version_store import VersionStore
from rollstream.tiny.text_model import build_tiny_model, default_corpus
from rollstream.wire import Episode, PromptTask, TaskFailed, decode_dead_letter, decode_episode
from rollstream.wire.torch_tensors import decode_tensor_dict
from rollstream.kafka.topics import TopicNames


pytestmark = pytest.mark.broker

GROUP_TIER = "rollout-worker"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("rollout-model") / "tiny", default_corpus(),
                            vocab_size=300, hidden_size=32, num_layers=2, num_heads=4)


def _config(kafka_bootstrap: str, redis_url: str, name: str, model: Path, **rollout: Any) -> RollstreamConfig:
    settings = {"model_path": str(model), "seed": 0, "worker_id": "w-test", "commit_interval_seconds": 0.2,
                "max_concurrent_rollouts": 4, "gconfig": {"max_new_tokens": 8}, **rollout}
    return make_config(kafka_bootstrap, redis_url, name, {"rollout": settings})


def _prompt(task_id: str, group_size: int = 2, **extra: Any) -> PromptTask:
    n = int(task_id.rsplit("-", 1)[-1])
    return PromptTask(task_id=task_id, group_size=group_size, data={"prompt": f"What is {n}+{n}?"}, **extra)


def episodes(messages: list[Any]) -> list[Episode]:
    return [m for m in messages if isinstance(m, Episode)]


def sample_keys(messages: list[Any]) -> set[tuple[str, int]]:
    return {(m.task_id, m.sample_idx) for m in episodes(messages)}


async def _committed_vs_end(config: RollstreamConfig) -> tuple[dict[int, int], dict[int, int]]:
    names = TopicNames.of(config)
    admin = make_admin(config.kafka)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(names.group_id(GROUP_TIER))
    finally:
        await admin.close()
    consumer = make_consumer(config.kafka, "test-ends", group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(names.prompts, p) for p in range(config.kafka.partitions)]
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    return ({tp.partition: meta.offset for tp, meta in committed.items() if tp.topic == names.prompts},
            {tp.partition: offset for tp, offset in ends.items()})


def _check_episode(ep: Episode, version: int | None = 0) -> dict[str, torch.Tensor]:
    td = decode_tensor_dict(ep.trajectory)
    generated = td["loss_mask"] == 1
    assert ep.group_size == 2 and ep.worker_id and ep.stop_reason in ("stop", "length")
    assert not ep.has_reward and ep.data["prompt"].startswith("What is")
    assert generated.any() and bool((td["versions"][~generated] == -1).all())
    assert bool((td["logprobs"][~generated] == 0).all()) and bool(td["logprobs"].isfinite().all())
    assert bool((td["logprobs"][generated] <= 0).all())
    if version is not None:
        assert bool((td["versions"][generated] == version).all())
        assert (ep.head_version, ep.tail_version) == (version, version)
    return td


async def test_prompts_become_episodes_and_offsets_are_committed(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model: Path
) -> None:
    config = _config(kafka_bootstrap, redis_url, unique_name, tiny_model)
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    prompts = [_prompt(f"task-{i}") for i in range(6)]
    await publish_prompts(config, *prompts[:3], (b"bad-1", b"\x93not a prompt"),
                   _prompt("task-9", workflow="os.system"), *prompts[3:])
    stop = asyncio.Event()
    service = asyncio.create_task(run(config, stop))
    async with TopicReader(config, names.episodes, decode_episode) as reader:
        wanted = {(p.task_id, i) for p in prompts for i in range(2)}
        failed_ids = {"bad-1", "task-9"}
        msgs = await reader.until(
            lambda m: sample_keys(m) >= wanted and {x.task_id for x in m if isinstance(x, TaskFailed)} >= failed_ids,
            timeout=120, what="12 samples and 2 TaskFailed",
        )
    await stop_worker(service, stop)
    assert len(episodes(msgs)) == 12  # no failures, no duplicates in a clean run
    for ep in episodes(msgs):
        td = _check_episode(ep)
        assert ep.data == next(p.data for p in prompts if p.task_id == ep.task_id)
        assert td["input_ids"].shape[0] == 1
    failures = {m.task_id: m for m in msgs if isinstance(m, TaskFailed)}
    assert "not allowed" in failures["task-9"].reason and failures["task-9"].group_size == 2
    assert failures["bad-1"].reason
    async with TopicReader(config, names.dead_letter, decode_dead_letter) as letters:
        dead = await letters.until(lambda m: len(m) >= 2, timeout=30, what="2 dead letters")
    by_key = {d.key: d for d in dead}
    assert by_key[b"bad-1"].value == b"\x93not a prompt" and by_key[b"bad-1"].tier == GROUP_TIER
    assert by_key[b"bad-1"].source_topic == names.prompts
    assert "os.system" in by_key[b"task-9"].reason
    committed, ends = await _committed_vs_end(config)
    assert committed == ends and sum(ends.values()) == 8


def _perturbed_copy(model: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in lm.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.5)
    lm.save_pretrained(out)
    return out


async def test_worker_follows_published_weight_versions(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    long = {"max_new_tokens": 128}  # every sample that long (FULL_LENGTH_RLVR): a long window
    # Two samples at a time: four prompts of two samples take several waves, so the update
    # lands while some sample is mid-generation; the later prompts queue behind them.
    config = _config(kafka_bootstrap, redis_url, unique_name, tiny_model, gconfig=long, max_concurrent_rollouts=2,
                     workflows=FULL_LENGTH_RLVR)
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    weights = _perturbed_copy(tiny_model, tmp_path / "v1")
    first = [_prompt(f"a-{i}") for i in range(4)]
    later = [_prompt(f"b-{i}") for i in range(2)]
    await publish_prompts(config, *first)
    stop = asyncio.Event()
    service = asyncio.create_task(run(config, stop))
    redis = connect(config.redis)
    try:
        async with TopicReader(config, names.episodes, decode_episode) as reader:
            await reader.until(lambda m: len(episodes(m)) >= 1, timeout=120, what="a first episode")
            await VersionStore(redis, RedisKeys(config.experiment.experiment_name, "t0")).publish(
                WeightUpdate(1, str(weights)))
            await publish_prompts(config, *later)
            wanted = {(p.task_id, i) for p in first + later for i in range(2)}
            msgs = await reader.until(lambda m: sample_keys(m) >= wanted, timeout=180, what="all samples")
    finally:
        await redis.aclose()
    await stop_worker(service, stop)
    eps = episodes(msgs)
    for ep in eps:
        td = _check_episode(ep, version=None)
        gen_versions = td["versions"][td["loss_mask"] == 1].tolist()
        assert gen_versions == sorted(gen_versions) and set(gen_versions) <= {0, 1}
    assert all((ep.head_version, ep.tail_version) == (1, 1) for ep in eps if ep.task_id.startswith("b-"))
    assert any(ep.head_version == 0 for ep in eps)
    assert any((ep.head_version, ep.tail_version) == (0, 1) for ep in eps), "no episode spans the update"


async def test_a_join_while_redis_is_paused_runs_no_prompt_twice(
    kafka_bootstrap: str, unique_name: str, tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Worker b joins while Redis is frozen (SIGSTOP) for longer than the workers' failure
    detection time: every liveness key has expired when Redis wakes, and the partitions move
    right after. Neither worker runs a prompt the other runs: nothing waits for a Redis that
    cannot answer except what a worker cannot know by itself, and after the outage no absence
    (a claim, a holder's liveness) is trusted until the live workers wrote theirs again."""
    caplog.set_level(logging.INFO, logger="rollstream.rollout_workers")
    slow = {"max_new_tokens": 384}  # every sample that long (FULL_LENGTH_RLVR)
    with LocalRedisServer(tmp_path / "redis") as redis:
        # after the first two samples, samples end only once the gate opens (after the partitions
        # moved), so prompts are running at the revocation however fast this machine generates
        close_gate()
        config_a = _config(kafka_bootstrap, redis.url, unique_name, tiny_model, gconfig=slow,
                           max_concurrent_rollouts=8, worker_id="w-a", failure_detection_seconds=6,
                           workflows=GATED_FULL_LENGTH_RLVR)
        config_b = msgspec.structs.replace(config_a, rollout=msgspec.structs.replace(config_a.rollout, worker_id="w-b"))
        names = TopicNames.of(config_a)
        await ensure_topics(config_a.kafka, names)
        prompts = [_prompt(f"task-{i}") for i in range(16)]
        await publish_prompts(config_a, *prompts)
        wanted = {(p.task_id, i) for p in prompts for i in range(2)}
        stop_a, stop_b = asyncio.Event(), asyncio.Event()
        worker_a = asyncio.create_task(run(config_a, stop_a))
        async with TopicReader(config_a, names.episodes, decode_episode) as reader:
            # a's first claims waited until Redis served them for a window (see claim_scripts)
            await reader.until(lambda m: len(episodes(m)) >= 1, timeout=120, what="a first episode")
            worker_b = asyncio.create_task(run(config_b, stop_b))
            client = connect(config_a.redis)
            b_alive = RedisKeys(unique_name, "t0").key("worker:w-b")
            while not await client.exists(b_alive):  # b registered; its consumer joins next
                await asyncio.sleep(0.05)
            await client.aclose()
            redis.pause()  # from just before b joins the group: the partitions move while Redis is frozen
            try:
                await reader.until(lambda _: revoked(caplog), timeout=120, what="worker a's partitions revoked")
                await asyncio.sleep(8)  # past the liveness keys' lifetime: they expire when Redis wakes
            finally:
                redis.resume()
                GATE.set()
            await reader.until(lambda m: sample_keys(m) >= wanted, timeout=180, what="all samples")
            # Prompts that were running when their partition moved publish from the old owner;
            # the new owner finds their claims, waits for them and then commits past them.
            await _until_committed_to_end(config_a, timeout=120)
            await stop_worker(worker_a, stop_a)
            await stop_worker(worker_b, stop_b)
            await reader.drain()
        leftover = await connect(config_a.redis).keys(RedisKeys(unique_name, "t0").key("claim:*"))
    assert revoked(caplog)
    for ep in episodes(reader.messages):
        _check_episode(ep)
    published = [(ep.task_id, ep.sample_idx) for ep in episodes(reader.messages)]
    assert len(published) == len(set(published)) == 32, "a prompt ran twice although its worker lived"
    committed, ends = await _committed_vs_end(config_a)
    assert committed == ends and sum(ends.values()) == 16
    assert unfinished_at_revocation(caplog) > 0  # prompts were running when their partition moved
    assert len(leftover) <= 2, leftover  # claims are deleted once committed past (the last commits may lag)


def revoked(caplog: pytest.LogCaptureFixture) -> bool:
    return any("partitions revoked" in r.getMessage() for r in caplog.records)


def unfinished_at_revocation(caplog: pytest.LogCaptureFixture) -> int:
    found = [re.search(r"\((\d+) prompts not finished", r.getMessage()) for r in caplog.records]
    return max((int(m.group(1)) for m in found if m), default=0)


async def _until_committed_to_end(config: RollstreamConfig, timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        committed, ends = await _committed_vs_end(config)
        if committed == ends:
            return
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"committed offsets {committed} never reached the end offsets {ends}")
        await asyncio.sleep(0.5)


@pytest.mark.slow
async def test_crashed_worker_prompts_are_rerun_and_a_sigterm_finishes_its_own(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    slow = {"max_new_tokens": 128}  # every sample that long (FULL_LENGTH_RLVR)
    config = _config(kafka_bootstrap, redis_url, unique_name, tiny_model, gconfig=slow,
                     max_concurrent_rollouts=1, shutdown_grace_seconds=20, workflows=FULL_LENGTH_RLVR)
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    config_file = tmp_path / "worker.yaml"
    config_file.write_text(yaml.safe_dump(msgspec.to_builtins(config)))
    prompts = [_prompt(f"task-{i}") for i in range(6)]
    placed = await publish_prompts(config, *prompts)
    wanted = {(p.task_id, i) for p in prompts for i in range(2)}
    worker = TierProcess("rollout-worker", config_file, tmp_path / "workers.log").start()
    try:
        async with TopicReader(config, names.episodes, decode_episode) as reader:
            await reader.until(lambda m: len(episodes(m)) >= 2, timeout=180, what="episodes of worker 1")
            worker.kill()
            assert sample_keys(reader.messages) < wanted, "worker 1 finished everything before the kill"
            worker.start()  # the second run
            await reader.until(lambda m: sample_keys(m) >= wanted, timeout=240,
                               what=lambda: f"all samples after the restart\n{worker.tail(40)}")
            more = [_prompt(f"task-{i}") for i in range(6, 9)]
            placed.update(await publish_prompts(config, *more))
            await reader.until(lambda m: any(k[0] in {"task-6", "task-7", "task-8"} for k in sample_keys(m)),
                               timeout=120, what="a sample of the later prompts")
            # SIGTERM mid-run: it leaves the group, its prompts finish
            assert await asyncio.to_thread(worker.stop, 60) == 0, worker.tail(40)
            await reader.drain()
            finished_by_second = {k for k in sample_keys(reader.messages) if k[0] in {"task-6", "task-7", "task-8"}}
            # a third run commits past what the second finished (its claims say done) and
            # generates none of it again
            worker.start()
            await _until_committed_to_end(config, timeout=240)
            await reader.until(lambda m: sample_keys(m) >= {(f"task-{i}", s) for i in range(9) for s in (0, 1)},
                               timeout=120, what="every sample of the later prompts")
            assert await asyncio.to_thread(worker.stop, 60) == 0, worker.tail(40)
            await reader.drain()
    finally:
        worker.kill()
    committed, ends = await _committed_vs_end(config)
    assert committed == ends and sum(ends.values()) == 9
    later = [(ep.task_id, ep.sample_idx) for ep in episodes(reader.messages) if ep.task_id in {"task-6", "task-7", "task-8"}]
    assert len(later) == len(set(later)) == 6, worker.tail(40)  # a prompt finished on SIGTERM is never run again
    assert finished_by_second, worker.tail(40)  # the SIGTERM came while a later prompt was running


async def test_dump_to_file_writes_the_reference_layout(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    """``rollout.dump_to_file`` writes one JSONL line per sample under the reference layout."""
    config = _config(kafka_bootstrap, redis_url, unique_name, tiny_model,
                     dump_to_file=True, fileroot=str(tmp_path / "dumps"))
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    await publish_prompts(config, _prompt("task-1"), _prompt("task-2"))
    stop = asyncio.Event()
    service = asyncio.create_task(run(config, stop))
    async with TopicReader(config, names.episodes, decode_episode) as reader:
        await reader.until(lambda m: len(sample_keys(m)) >= 4, timeout=120, what="4 samples")
    await stop_worker(service, stop)
    root = tmp_path / "dumps" / unique_name / config.experiment.trial_name / "rollout"
    lines = [json.loads(line) for path in sorted(root.glob("*/*.jsonl")) for line in path.read_text().splitlines()]
    assert sorted((d["task_id"], d["sample_idx"]) for d in lines) == [
        ("task-1", 0), ("task-1", 1), ("task-2", 0), ("task-2", 1)]
    for line in lines:
        assert line["head_version"] == 0 and line["tail_version"] == 0
        assert 0 < line["prompt_len"] < line["seqlen"] and line["completion"]
        assert (root / "0" / f"{line['task_id']}.jsonl").exists()

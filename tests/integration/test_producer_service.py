"""The producer tier against the real broker and Redis: exactly-once prompts and admission."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from harness.producer_feed import producer_config, read_prompts, write_dataset
from rollstream.api.engine import WeightUpdate
from rollstream.config import RollstreamConfig
from rollstream.kafka.clients import make_consumer
from rollstream.producers.cursor import read_cursor
from rollstream.producers.dataset import iter_samples, task_id_for
from rollstream.producers.service import RunSummary, run, run_producer
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys, connect
from rollstream.state.version_store import VersionStore
from rollstream.wire import decode_dead_letter
from rollstream.kafka.topics import TopicNames


pytestmark = pytest.mark.broker


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout: float = 30.0, poll: float = 0.1
) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(poll)


async def count_prompts(config: RollstreamConfig, n: int) -> bool:
    return len(await read_prompts(config)) >= n


def start_producer(config: RollstreamConfig, stop: asyncio.Event) -> asyncio.Task[RunSummary]:
    return asyncio.create_task(run_producer(config, stop))


async def test_publishes_every_sample_once_with_its_fields(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    dataset = write_dataset(tmp_path / "d.jsonl", 5)
    config = producer_config(
        kafka_bootstrap, redis_url, unique_name, dataset, epochs=2, shuffle=True, seed=3, workflow="rlvr"
    )
    await asyncio.wait_for(run(config, asyncio.Event()), 60)  # burst: returns when exhausted

    prompts = await read_prompts(config)
    expected = {task_id_for("producer-0", e, i): r for e, i, r in iter_samples(5, 2, True, 3)}
    assert sorted(t.task_id for _, t in prompts) == sorted(expected)
    for key, task in prompts:
        assert key == task.task_id.encode()
        assert task.data == {"question": f"q{expected[task.task_id]}", "answer": str(expected[task.task_id])}
        assert (task.group_size, task.is_eval, task.workflow) == (3, False, "rlvr")
        assert task.task_id == f"producer-0:{task.epoch}:{task.index}" and task.created_at > 0
    cursor = await read_cursor(config, TopicNames.of(config), "producer-0")
    assert cursor is not None and (cursor.epoch, cursor.index, cursor.published) == (2, 0, 10)

    # A rerun of an exhausted producer publishes nothing more.
    summary = await asyncio.wait_for(run_producer(config, asyncio.Event()), 60)
    assert (summary.published, summary.reason) == (0, "exhausted")
    assert len(await read_prompts(config)) == 10


async def test_max_prompts_counts_across_restarts(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    dataset = write_dataset(tmp_path / "d.jsonl", 10)
    config = producer_config(kafka_bootstrap, redis_url, unique_name, dataset, max_prompts=4)
    summary = await asyncio.wait_for(run_producer(config, asyncio.Event()), 60)
    assert (summary.published, summary.reason) == (4, "max_prompts")
    summary = await asyncio.wait_for(run_producer(config, asyncio.Event()), 60)
    assert summary.published == 0
    assert sorted(t.index for _, t in await read_prompts(config)) == [0, 1, 2, 3]


async def test_stopped_while_waiting_then_restarted_publishes_the_rest_exactly_once(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    dataset = write_dataset(tmp_path / "d.jsonl", 7)
    config = producer_config(
        kafka_bootstrap, redis_url, unique_name, dataset, epochs=2, shuffle=True,
        staleness={"groups_per_step": 5, "max_head_offpolicyness": 0},
    )
    stop = asyncio.Event()
    task = start_producer(config, stop)
    await eventually(lambda: count_prompts(config, 5))
    stop.set()
    first = await asyncio.wait_for(task, 30)
    assert (first.published, first.reason) == (5, "stopped")

    redis = connect(config.redis)
    keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
    await VersionStore(redis, keys).publish(WeightUpdate(100, "/weights/100"))
    await redis.aclose()
    second = await asyncio.wait_for(run_producer(config, asyncio.Event()), 60)
    assert (second.published, second.total_published) == (9, 14)

    ids = [t.task_id for _, t in await read_prompts(config)]
    assert len(ids) == len(set(ids)) == 14
    assert set(ids) == {task_id_for("producer-0", e, i) for e, i, _ in iter_samples(7, 2, True, 0)}


async def test_stopped_mid_stream_then_restarted_skips_and_repeats_nothing(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    n = 30
    dataset = write_dataset(tmp_path / "d.jsonl", n)
    # One prompt per transaction, so the stop lands in the middle of an active stream.
    config = producer_config(
        kafka_bootstrap, redis_url, unique_name, dataset, max_batch_prompts=1, batch_linger_ms=0
    )
    redis = connect(config.redis)
    budget = StalenessBudget(redis, RedisKeys(config.experiment.experiment_name, "t0"), 0, 1000)
    stop = asyncio.Event()
    task = start_producer(config, stop)

    async def admitted_enough() -> bool:
        return (await budget.usage())["admitted"] >= 5 or task.done()

    await eventually(admitted_enough, poll=0.005)
    stop.set()
    first = await asyncio.wait_for(task, 30)
    assert first.reason == "stopped" and 0 < first.published < n
    second = await asyncio.wait_for(run_producer(config, asyncio.Event()), 60)
    await redis.aclose()

    ids = [t.task_id for _, t in await read_prompts(config)]
    assert first.published + second.published == n
    assert sorted(ids) == sorted(task_id_for("producer-0", 0, i) for i in range(n))


async def test_staleness_gating_follows_versions_and_releases(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    dataset = write_dataset(tmp_path / "d.jsonl", 20)
    config = producer_config(
        kafka_bootstrap, redis_url, unique_name, dataset,
        staleness={"groups_per_step": 2, "max_head_offpolicyness": 0},
    )
    redis = connect(config.redis)
    keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
    budget = StalenessBudget(redis, keys, 0, 2)
    stop = asyncio.Event()
    task = start_producer(config, stop)
    try:
        await expect_exactly(config, 2)
        await VersionStore(redis, keys).publish(WeightUpdate(1, "/weights/1"))
        await expect_exactly(config, 4)
        await budget.release("producer-0:0:0", "all_rejected")
        await budget.notify()
        await expect_exactly(config, 5)
        assert (await budget.usage())["admitted"] == 5
    finally:
        stop.set()
        summary = await asyncio.wait_for(task, 30)
        await redis.aclose()
    assert (summary.published, summary.reason) == (5, "stopped") and summary.admission_waits >= 3


async def expect_exactly(config: RollstreamConfig, n: int, settle: float = 1.0) -> None:
    """``n`` prompts become visible, and no more appear within ``settle`` seconds."""
    await eventually(lambda: count_prompts(config, n))
    await asyncio.sleep(settle)
    assert len(await read_prompts(config)) == n


async def test_two_producers_share_one_bound(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    dataset = write_dataset(tmp_path / "d.jsonl", 10)
    staleness = {"groups_per_step": 3, "max_head_offpolicyness": 0}
    configs = [
        producer_config(kafka_bootstrap, redis_url, unique_name, dataset, producer_id=pid, staleness=dict(staleness))
        for pid in ("prod-a", "prod-b")
    ]
    stop = asyncio.Event()
    tasks = [start_producer(c, stop) for c in configs]
    redis = connect(configs[0].redis)
    keys = RedisKeys(configs[0].experiment.experiment_name, configs[0].experiment.trial_name)
    try:
        await expect_exactly(configs[0], 3)
        await VersionStore(redis, keys).publish(WeightUpdate(1, "/weights/1"))
        await expect_exactly(configs[0], 6)
        usage = await StalenessBudget(redis, keys, 0, 3).usage()
        assert usage["admitted"] == 6 <= usage["capacity"]
    finally:
        stop.set()
        summaries = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await redis.aclose()
    assert sum(s.published for s in summaries) == 6
    ids = [t.task_id for _, t in await read_prompts(configs[0])]
    assert len(set(ids)) == 6


async def test_eval_prompts_are_not_gated(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    dataset = write_dataset(tmp_path / "d.jsonl", 6)
    config = producer_config(
        kafka_bootstrap, redis_url, unique_name, dataset, is_eval=True, producer_id="eval-0",
        staleness={"groups_per_step": 1, "max_head_offpolicyness": 0},
    )
    summary = await asyncio.wait_for(run_producer(config, asyncio.Event()), 60)
    assert (summary.published, summary.eval_prompts, summary.admission_waits) == (6, 6, 0)
    prompts = await read_prompts(config)
    assert len(prompts) == 6 and all(t.is_eval for _, t in prompts)
    redis = connect(config.redis)
    keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
    assert (await StalenessBudget(redis, keys, 0, 1).usage())["admitted"] == 0
    await redis.aclose()


async def test_unencodable_row_is_dead_lettered_and_skipped(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"q": 0}\n{"q": 100000000000000000000000000000}\n{"q": 2}\n')  # row 1: int too big
    config = producer_config(kafka_bootstrap, redis_url, unique_name, str(path))
    summary = await asyncio.wait_for(run_producer(config, asyncio.Event()), 60)
    assert (summary.published, summary.dead_lettered) == (2, 1)
    assert sorted(t.index for _, t in await read_prompts(config)) == [0, 2]

    consumer = make_consumer(config.kafka, "test-dl", TopicNames.of(config).dead_letter, group_id=None)
    await consumer.start()
    try:
        records = await consumer.getmany(timeout_ms=5000)
    finally:
        await consumer.stop()
    [letter] = [decode_dead_letter(r.value) for rs in records.values() for r in rs]
    assert (letter.tier, letter.offset, letter.key) == ("producer", 1, b"producer-0:0:1")
    assert "cannot be encoded" in letter.reason
    cursor = await read_cursor(config, TopicNames.of(config), "producer-0")
    assert cursor is not None and (cursor.epoch, cursor.index, cursor.published) == (1, 0, 2)

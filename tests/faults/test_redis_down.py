"""Redis down and back: producers wait instead of over-admitting, workers keep their version.

Each test runs its own redis-server (so stopping it disturbs no other test) against the
session's real broker, with the tiers in-process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from harness.configs import make_config
from harness.ledger import read_topic
from rollstream.api.engine import WeightUpdate
from rollstream.config import RollstreamConfig
from rollstream.dev.redis_server import LocalRedisServer
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.producers.service import run_producer
from rollstream.rollout_workers.service import run as run_rollout_worker
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys, connect
from rollstream.state.version_store import VersionStore
from rollstream.wire import Episode, PromptTask, decode_episode, decode_prompt, encode


pytestmark = [pytest.mark.broker, pytest.mark.timeout(180)]


async def until(predicate: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.2)


async def test_producer_waits_for_redis_and_never_over_admits(
    kafka_bootstrap: str, unique_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rollstream.producers")
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(20)))
    with LocalRedisServer(tmp_path / "redis", appendonly=True) as redis:
        config = make_config(kafka_bootstrap, redis.url, unique_name, {
            "producer": {"dataset": str(dataset), "group_size": 2, "admission_poll_seconds": 0.2},
            "staleness": {"groups_per_step": 4, "max_head_offpolicyness": 0},  # room for 4 prompts at version 0
        })
        names = TopicNames.of(config)
        await ensure_topics(config.kafka, names)

        async def published() -> int:
            return len(await read_topic(config.kafka, names.prompts, decode_prompt))

        redis.stop()
        stop = asyncio.Event()
        producer = asyncio.create_task(run_producer(config, stop))
        await asyncio.sleep(4.0)
        assert not producer.done() and await published() == 0, "published without Redis"
        assert any("unreachable" in r.getMessage() for r in caplog.records)

        redis.start()  # the counters are still there (appendonly): the budget is 4
        await until(lambda: _eq(published(), 4), 60, "the 4 prompts the budget allows")
        redis.restart()  # down and up again while the producer waits for room
        await asyncio.sleep(3.0)
        assert await published() == 4, "admitted past the budget across a Redis restart"

        client = connect(config.redis)
        keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
        try:
            await _publish_version(VersionStore(client, keys), WeightUpdate(1, "unused"))  # room for 4 more
            await until(lambda: _eq(published(), 8), 60, "4 more prompts after version 1")
            await asyncio.sleep(1.0)
            usage = await StalenessBudget(client, keys, 0, 4).usage()
        finally:
            await client.aclose()
        stop.set()
        summary = await asyncio.wait_for(producer, 60)
    assert await published() == 8 and summary.total_published == 8
    assert usage["admitted"] == 8 and usage["capacity"] == 8


async def _eq(value: Any, expected: int) -> bool:
    return await value == expected


async def test_rollout_worker_keeps_its_version_while_redis_is_down(
    kafka_bootstrap: str, unique_name: str, tmp_path: Path, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Version 1 is loaded; Redis dies, then comes back EMPTY (no persistence): the worker goes
    on generating with version 1, ignores the store's version going back to 0, and follows
    version 2 once the trainer publishes it."""
    caplog.set_level(logging.INFO, logger="rollstream.rollout_workers")
    with LocalRedisServer(tmp_path / "redis") as redis:
        config = make_config(kafka_bootstrap, redis.url, unique_name, {"rollout": {
            "model_path": str(tiny_model), "seed": 0, "worker_id": "w-redis", "max_concurrent_rollouts": 4,
            "commit_interval_seconds": 0.2, "gconfig": {"max_new_tokens": 3},
        }})
        names = TopicNames.of(config)
        await ensure_topics(config.kafka, names)
        keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
        client = connect(config.redis)
        await VersionStore(client, keys).publish(WeightUpdate(1, str(tiny_model)))
        stop = asyncio.Event()
        worker = asyncio.create_task(run_rollout_worker(config, stop))
        try:
            await _prompts(config, "a", 2)
            await _until_versions(config, {"a-0", "a-1"}, {1})
            redis.stop()
            await _prompts(config, "b", 2)  # generated while Redis is down
            await _until_versions(config, {"b-0", "b-1"}, {1})
            redis.start()  # empty: the store says version 0 now
            await asyncio.sleep(2.5)  # the follower polls every 2 s
            await _prompts(config, "c", 2)
            await _until_versions(config, {"c-0", "c-1"}, {1})
            await _publish_version(VersionStore(client, keys), WeightUpdate(2, str(tiny_model)))
            await until(lambda: _logged(caplog, "now generating with weight version 2"), 60, "version 2")
            await _prompts(config, "d", 2)
            await _until_versions(config, {"d-0", "d-1"}, {2})
            assert not worker.done()
        finally:
            stop.set()
            await asyncio.wait_for(worker, 60)
            await client.aclose()
    messages = [r.getMessage() for r in caplog.records]
    assert any("version store unreachable" in m and "keeping version 1" in m for m in messages)
    assert any("version store went back to 0" in m for m in messages)


async def _publish_version(store: VersionStore, update: WeightUpdate) -> None:
    """The test's own client may hold a connection from before the restart: one retry."""
    try:
        await store.publish(update)
    except RedisConnectionError:
        await store.publish(update)


async def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)


async def _prompts(config: RollstreamConfig, prefix: str, n: int) -> None:
    producer = make_producer(config.kafka, "test-prompts")
    await producer.start()
    try:
        for i in range(n):
            task = PromptTask(task_id=f"{prefix}-{i}", group_size=2, data={"prompt": f"What is {i}+{i}?"})
            await producer.send_and_wait(TopicNames.of(config).prompts, encode(task), key=task.task_id.encode())
    finally:
        await producer.stop()


async def _until_versions(config: RollstreamConfig, tasks: set[str], versions: set[int]) -> None:
    """Wait until every sample of ``tasks`` is on ``episodes``; their head versions must be ``versions``."""
    seen: dict[tuple[str, int], int] = {}

    async def done() -> bool:
        for message in await read_topic(config.kafka, TopicNames.of(config).episodes, decode_episode):
            if isinstance(message, Episode) and message.task_id in tasks:
                seen[(message.task_id, message.sample_idx)] = message.head_version
        return len(seen) == 2 * len(tasks)

    await until(done, 90, f"samples of {sorted(tasks)}")
    assert set(seen.values()) == versions, seen

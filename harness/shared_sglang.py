"""Pieces of the shared-SGLang tests: rollout-worker configs, a prompt feed, a trainer-like
version publisher, and reading the published episodes back."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

from harness.configs import make_config
from harness.fake_sglang import FakeSGLangServer
from harness.ledger import read_topic
from rollstream.api.engine import WeightUpdate
from rollstream.config import RolloutConfig, RollstreamConfig
from rollstream.engines.sglang import SGLangEngine
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.state.client import RedisKeys, connect
from rollstream.state.server_lease import ServerLeases
from rollstream.state.version_store import VersionStore
from rollstream.wire import Episode, PromptTask, SampleRejected, decode_episode, encode


ENGINES: dict[str, SGLangEngine] = {}  # by worker id, filled by make_engine (in-process workers)


def make_engine(config: RolloutConfig) -> SGLangEngine:
    """A ``rollout.engine_factory``: the production SGLangEngine, kept where the test can see it."""
    engine = SGLangEngine(config.server_urls, config.tokenizer_path, config.server)
    ENGINES[config.worker_id] = engine
    return engine


def worker_settings(servers: list[FakeSGLangServer], tokenizer: Path, worker_id: str, **server: Any) -> dict:
    return {
        "engine": "sglang", "server_urls": [s.url for s in servers], "tokenizer_path": str(tokenizer),
        "worker_id": worker_id, "max_concurrent_rollouts": 4, "commit_interval_seconds": 0.2,
        "gconfig": {"max_new_tokens": 24},
        "server": {"lease_ttl_seconds": 3.0, "reconcile_seconds": 1.0, "version_poll_seconds": 0.05,
                   "backoff_base_seconds": 0.05, "backoff_max_seconds": 0.5, "catch_up_timeout_seconds": 60.0,
                   **server},
    }


def shared_config(kafka_bootstrap: str, redis_url: str, name: str, rollout: dict) -> RollstreamConfig:
    return make_config(kafka_bootstrap, redis_url, name, {"kafka": {"partitions": 6}, "rollout": rollout})



class PromptFeed:
    """Publishes one prompt (two samples) every ``interval`` seconds until stopped."""

    def __init__(self, config: RollstreamConfig, interval: float = 0.15) -> None:
        self.config, self.interval = config, interval
        self.wanted: set[tuple[str, int]] = set()
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        producer = make_producer(self.config.kafka, "test-prompts")
        await producer.start()
        try:
            i = 0
            while not self._stop.is_set():
                task = PromptTask(task_id=f"p{i}", group_size=2, data={"prompt": f"What is {i % 10}+1?"})
                await producer.send_and_wait(TopicNames.of(self.config).prompts, encode(task), key=task.task_id.encode())
                self.wanted |= {(task.task_id, 0), (task.task_id, 1)}
                i += 1
                await asyncio.sleep(self.interval)
        finally:
            await producer.stop()


async def publish_versions(config: RollstreamConfig, versions: range, every: float) -> list[float]:
    """A trainer: publish each version (weights at /ckpt/v<n>) ``every`` seconds; publish times."""
    redis = connect(config.redis)
    store = VersionStore(redis, RedisKeys(config.experiment.experiment_name, config.experiment.trial_name))
    times = []
    try:
        for version in versions:
            await asyncio.sleep(every)
            await store.publish(WeightUpdate(version, f"/ckpt/v{version}"))
            times.append(time.monotonic())
    finally:
        await redis.aclose()
    return times


async def samples(config: RollstreamConfig, wanted: set[tuple[str, int]],
                  timeout: float = 120) -> tuple[dict[tuple[str, int], Any], list[Episode]]:
    """Wait until one message per wanted ``(task_id, sample_idx)`` was published. Returns the
    last message per wanted sample, and every episode published (re-runs included)."""
    deadline = time.monotonic() + timeout
    while True:
        messages = await read_topic(config.kafka, TopicNames.of(config).episodes, decode_episode)
        found = {(m.task_id, m.sample_idx): m for m in messages
                 if isinstance(m, (Episode, SampleRejected)) and (m.task_id, m.sample_idx) in wanted}
        if len(found) == len(wanted):
            return found, [m for m in messages if isinstance(m, Episode)]
        assert time.monotonic() < deadline, f"only {len(found)} of {len(wanted)} samples arrived"
        await asyncio.sleep(0.5)


async def owners_elected(config: RollstreamConfig, servers: list[FakeSGLangServer], timeout: float = 120) -> None:
    """Wait until every server has a sync owner."""
    redis = connect(config.redis)
    keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
    leases = ServerLeases(redis, keys, "observer", 1.0)
    deadline = time.monotonic() + timeout
    try:
        while not all([await leases.holder(s.url) for s in servers]):
            assert time.monotonic() < deadline, "no sync owner elected"
            await asyncio.sleep(0.1)
    finally:
        await redis.aclose()


def loads_per_version(server: FakeSGLangServer) -> Counter[int | None]:
    return Counter(load.version for load in server.loads)

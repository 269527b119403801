"""SGLang servers that die or answer 5xx, under a running rollout worker.

The servers are ``tests.fakes.FakeSGLangServer``: a real SGLang server needs a GPU, which the CI
machine lacks, so a fake that speaks SGLang's native HTTP API stands in for it (the engine's
own unit tests cover the client in detail; this test covers the tier). The rollout worker runs
in-process against the session's real broker, with the default settings of ``SGLangEngine``
(3 retries with backoff, a server marked down after 2 failures in a row, for 30 s).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from rollout_workers.service import run
from rollstream.config import RollstreamConfig
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.wire import Episode, PromptTask, SampleRejected, decode_episode, encode
from tests.fakes import FakeSGLangServer
from tests.faults.ledger import read_topic
from tests.helpers import make_config

pytestmark = [pytest.mark.broker, pytest.mark.timeout(180)]


def names_of(config: RollstreamConfig) -> TopicNames:
    return TopicNames(config.experiment.experiment_name, config.experiment.trial_name)


async def publish(config: RollstreamConfig, prefix: str, n: int) -> set[tuple[str, int]]:
    producer = make_producer(config.kafka, "test-prompts")
    await producer.start()
    try:
        for i in range(n):
            task = PromptTask(task_id=f"{prefix}-{i}", group_size=2, data={"prompt": f"What is {i}+1?"})
            await producer.send_and_wait(names_of(config).prompts, encode(task), key=task.task_id.encode())
    finally:
        await producer.stop()
    return {(f"{prefix}-{i}", s) for i in range(n) for s in range(2)}


async def samples(config: RollstreamConfig, wanted: set[tuple[str, int]], timeout: float = 90) -> dict:
    """Wait for one message per wanted ``(task_id, sample_idx)``; returns them."""
    deadline = time.monotonic() + timeout
    while True:
        found = {(m.task_id, m.sample_idx): m
                 for m in await read_topic(config.kafka, names_of(config).episodes, decode_episode)
                 if isinstance(m, (Episode, SampleRejected)) and (m.task_id, m.sample_idx) in wanted}
        if len(found) == len(wanted):
            return found
        assert time.monotonic() < deadline, f"only {len(found)} of {len(wanted)} samples arrived"
        await asyncio.sleep(0.3)


async def test_failover_then_no_server_left(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model: Path
) -> None:
    async with FakeSGLangServer(vocab_size=300, token_delay=0.005) as a, \
            FakeSGLangServer(vocab_size=300, token_delay=0.005) as b:
        config = make_config(kafka_bootstrap, redis_url, unique_name, {"rollout": {
            "engine": "sglang", "sglang_urls": [a.url, b.url], "tokenizer_path": str(tiny_model),
            "worker_id": "w-sglang", "max_concurrent_rollouts": 4, "commit_interval_seconds": 0.2,
            "gconfig": {"max_new_tokens": 6},
        }})
        await ensure_topics(config.kafka, names_of(config))
        stop = asyncio.Event()
        worker = asyncio.create_task(run(config, stop))
        try:
            both = await samples(config, await publish(config, "up", 3))
            assert all(isinstance(m, Episode) for m in both.values())
            assert a.hits["generate"] and b.hits["generate"]  # both servers took work

            await a.go_down()  # a crash: in-flight and new requests move to b
            served_by_b = b.hits["generate"]
            one = await samples(config, await publish(config, "failover", 4))
            assert all(isinstance(m, Episode) for m in one.values()), one
            assert b.hits["generate"] >= served_by_b + 8

            b.fail_next(10**6, 500)  # the last server answers 500s: no server is left
            before = b.hits["generate"]
            started = time.monotonic()
            none_left = await samples(config, await publish(config, "none-left", 2))
            spent = time.monotonic() - started
            for message in none_left.values():  # a failed sample with a clear reason, not a hang
                assert isinstance(message, SampleRejected) and message.failed, message
                assert message.reason.startswith("EngineUnavailableError"), message.reason
            requests = b.hits["generate"] - before
            # 4 samples, each at most 4 attempts (3 retries), fewer once b is marked down
            assert 1 <= requests <= 16, requests
            await asyncio.sleep(3.0)  # idle: no retry loop keeps hammering the dead servers
            assert b.hits["generate"] - before == requests

            later = await samples(config, await publish(config, "still-down", 1))
            assert all("no SGLang server available" in m.reason for m in later.values()), later
            assert b.hits["generate"] - before == requests  # marked down: fails fast, no request
            assert not worker.done()
        finally:
            stop.set()
            await asyncio.wait_for(worker, 60)
    print(f"no server left: {requests} requests to the failing server for 4 samples in {spent:.1f}s, "
          "then none while idle and none for a later prompt")

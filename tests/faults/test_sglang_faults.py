"""SGLang servers that die or answer 5xx, and a sync owner SIGKILLed mid-update.

The servers are ``harness.fake_sglang.FakeSGLangServer``: a real SGLang server needs a GPU, which the CI
machine lacks, so a stand-in that follows SGLang 0.5.23's HTTP behaviour takes its place (the
engine's own unit tests cover the client in detail; these tests cover the tier). The failover
test runs one rollout worker in-process with the default ``rollout.server`` settings (3 retries
with backoff, a server marked down after 2 failures in a row, for 30 s); the owner test runs
three rollout-worker processes against the session's real broker and Redis.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest
import yaml

from harness.configs import make_config
from harness.fake_sglang import FakeSGLangServer
from harness.ledger_audit import audit
from harness.shared_sglang import (
    PromptFeed,
    loads_per_version,
    publish_versions,
    samples,
    shared_config,
    worker_settings,
)
from harness.tiers import TierProcess
from harness.waits import until, within
from rollstream.config import RollstreamConfig
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_producer
from rollstream.rollout_workers.service import run
from rollstream.state.client import RedisKeys, connect
from rollstream.state.server_lease import ServerLeases
from rollstream.wire import Episode, PromptTask, SampleRejected, encode
from rollstream.kafka.topics import TopicNames


pytestmark = [pytest.mark.broker, pytest.mark.timeout(300)]


async def publish(config: RollstreamConfig, prefix: str, n: int) -> set[tuple[str, int]]:
    producer = make_producer(config.kafka, "test-prompts")
    await producer.start()
    try:
        for i in range(n):
            task = PromptTask(task_id=f"{prefix}-{i}", group_size=2, data={"prompt": f"What is {i}+1?"})
            await producer.send_and_wait(TopicNames.of(config).prompts, encode(task), key=task.task_id.encode())
    finally:
        await producer.stop()
    return {(f"{prefix}-{i}", s) for i in range(n) for s in range(2)}


async def test_failover_then_no_server_left(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model: Path
) -> None:
    async with FakeSGLangServer(vocab_size=300, token_delay=0.005) as a, \
            FakeSGLangServer(vocab_size=300, token_delay=0.005) as b:
        config = make_config(kafka_bootstrap, redis_url, unique_name, {"rollout": {
            "engine": "sglang", "server_urls": [a.url, b.url], "tokenizer_path": str(tiny_model),
            "worker_id": "w-sglang", "max_concurrent_rollouts": 4, "commit_interval_seconds": 0.2,
            "gconfig": {"max_new_tokens": 6},
            "server": {"down_patience_seconds": 0},  # fail a sample at once while no server is left
        }})
        await ensure_topics(config.kafka, TopicNames.of(config))
        stop = asyncio.Event()
        worker = asyncio.create_task(run(config, stop))
        try:
            both, _ = await samples(config, await publish(config, "up", 3))
            assert all(isinstance(m, Episode) for m in both.values())
            assert a.hits["generate"] and b.hits["generate"]  # both servers took work

            await within(a.go_down(), 10, "server a going down")  # a crash: in-flight and new requests move to b
            served_by_b = b.hits["generate"]
            one, _ = await samples(config, await publish(config, "failover", 4))
            assert all(isinstance(m, Episode) for m in one.values()), one
            assert b.hits["generate"] >= served_by_b + 8

            b.fail_next(10**6, 500)  # the last server answers 500s: no server is left
            before = b.hits["generate"]
            started = time.monotonic()
            none_left, _ = await samples(config, await publish(config, "none-left", 2))
            spent = time.monotonic() - started
            for message in none_left.values():  # a failed sample with a clear reason, not a hang
                assert isinstance(message, SampleRejected) and message.failed, message
                assert message.reason.startswith("EngineUnavailableError"), message.reason
            requests = b.hits["generate"] - before
            # 4 samples, each at most 4 attempts (3 retries), fewer once b is marked down
            assert 1 <= requests <= 16, requests
            await asyncio.sleep(3.0)  # idle: no retry loop keeps hammering the dead servers
            assert b.hits["generate"] - before == requests

            later, _ = await samples(config, await publish(config, "still-down", 1))
            assert all("no SGLang server available within 0.0s" in m.reason for m in later.values()), later
            assert b.hits["generate"] - before == requests  # marked down: fails fast, no request
            assert not worker.done()
        finally:
            stop.set()
            await within(worker, 60, "the rollout worker stopping")
    print(f"no server left: {requests} requests to the failing server for 4 samples in {spent:.1f}s, "
          "then none while idle and none for a later prompt")


async def test_sigkilled_weight_sync_owner_is_replaced(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    """Three rollout-worker processes share two stand-ins. While the owner of a server is in
    the middle of loading version 2 on it (paused, load running), it is SIGKILLed. Another
    worker takes the server over once the dead owner's lease expires; every server reaches the
    newest version; every token keeps the tag of the weights that produced it; every prompt's
    samples arrive (the dead worker's prompts are re-run); no version is loaded twice."""
    async with FakeSGLangServer(vocab_size=300, token_delay=0.01, load_delay=1.0) as a, \
            FakeSGLangServer(vocab_size=300, token_delay=0.01, load_delay=1.0) as b:
        config = shared_config(kafka_bootstrap, redis_url, unique_name,
                               worker_settings([a, b], tiny_model, "unset"))
        config_file = tmp_path / "workers.yaml"
        config_file.write_text(yaml.safe_dump(msgspec.to_builtins(config)))
        await ensure_topics(config.kafka, TopicNames.of(config))
        workers = {f"w{i}": TierProcess("rollout-worker", config_file, tmp_path / f"w{i}.log",
                                        overrides=[f"rollout.worker_id=w{i}"], name=f"w{i}") for i in range(3)}
        logs = lambda: "\n".join(w.tail(15) for w in workers.values())  # noqa: E731
        leases = ServerLeases(connect(config.redis), RedisKeys(unique_name, "t0"), "observer", 1.0)
        feed = PromptFeed(config, interval=0.2)
        feeding = asyncio.create_task(feed.run())
        try:
            for worker in workers.values():
                worker.start()
            await until(lambda: all(w.grep("consuming") for w in workers.values()), "3 workers up", 120, logs)
            await publish_versions(config, range(1, 2), every=0.0)
            await until(lambda: a.version == b.version == 1 and not (a.paused or b.paused),
                        "both servers at v1", 60, logs)

            await publish_versions(config, range(2, 3), every=0.0)
            await until(lambda: a.loading.is_set() or b.loading.is_set(), "a load of v2", 60, logs)
            victim_server = a if a.loading.is_set() else b
            owner, token = await within(leases.holder(victim_server.url), 5, "reading the lease holder")
            victim = workers[owner.split(":")[0]]
            victim.kill()  # mid-update: the server is paused and loading
            killed_at = time.monotonic()
            assert victim_server.paused, "the kill should land between pause and continue"

            await until(lambda: a.version == b.version == 2 and not (a.paused or b.paused),
                        "every server at v2 and running again", 60, logs)
            taken_over = time.monotonic() - killed_at
            successor, new_token = await within(leases.holder(victim_server.url), 5, "reading the lease holder")
            assert successor.split(":")[0] != victim.name and new_token > token

            await within(publish_versions(config, range(3, 5), every=1.0), 30, "publishing v3 and v4")
            await until(lambda: a.version == b.version == 4 and not (a.paused or b.paused),
                        "every server at the newest version", 60, logs)
            feed.stop()
            await within(feeding, 30, "the prompt feed stopping")
            found, published = await samples(config, feed.wanted, timeout=150)
        finally:
            feed.stop()
            await within(asyncio.gather(feeding, return_exceptions=True), 30, "the prompt feed stopping")
            for worker in workers.values():
                worker.stop()
            await within(leases._redis.aclose(), 5, "closing the Redis client")

        failed = [m for m in found.values() if not isinstance(m, Episode)]
        assert not failed, failed[:3]
        result = audit(published, [a, b])
        print(f"\nowner {victim.name} SIGKILLed while loading v2 on {victim_server.url}; "
              f"{successor} took over after {taken_over:.1f}s; {len(feed.wanted) // 2} prompts; {result}")
        assert result.mistagged == 0 and result.unknown == 0, result.examples
        for server in (a, b):
            loads = loads_per_version(server)
            print(f"{server.url}: loads {dict(loads)}, pauses {server.hits['pause']}, refusals {dict(server.refusals)}")
            assert max(loads.values()) == 1 and loads[2] == loads[4] == 1, loads  # none twice, none lost
            assert server.refusals["duplicate_rid"] == 0

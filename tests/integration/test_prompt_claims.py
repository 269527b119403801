"""Prompt claims against a real Redis: who runs a prompt record, and when it may run again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from rollstream.dev.redis_server import LocalRedisServer
from rollstream.state.client import RedisKeys
from rollstream.rollout_workers.claims import Outcome, PromptClaims

pytestmark = pytest.mark.broker


def worker(client: aioredis.Redis, name: str, worker_id: str, detection: float = 10.0) -> PromptClaims:
    return PromptClaims(client, RedisKeys(name, "t0"), worker_id, detection)


async def test_a_prompt_runs_once_while_its_worker_lives(redis_client: aioredis.Redis, unique_name: str) -> None:
    a, b = worker(redis_client, unique_name, "a"), worker(redis_client, unique_name, "b")
    await a.heartbeat()
    await b.heartbeat()
    assert (await a.claim(0, 7)).outcome is Outcome.RUN
    assert (await a.claim(0, 7)).outcome is Outcome.MINE  # read again by the same process
    held = await b.claim(0, 7)
    assert held.outcome is Outcome.HELD and held.holder == "a" and not held.run_here
    await a.done(0, 7)
    assert (await b.claim(0, 7)).outcome is Outcome.DONE
    assert (await a.claim(0, 7)).outcome is Outcome.DONE


async def test_a_dead_workers_prompts_are_taken_over_once(redis_client: aioredis.Redis, unique_name: str) -> None:
    a = worker(redis_client, unique_name, "a", detection=1.0)
    b, c = worker(redis_client, unique_name, "b"), worker(redis_client, unique_name, "c")
    for w in (a, b, c):
        await w.heartbeat()
    assert (await a.claim(1, 0)).outcome is Outcome.RUN
    assert (await b.claim(1, 0)).outcome is Outcome.HELD
    await asyncio.sleep(1.3)  # a stops renewing: its liveness expires after failure_detection_seconds
    taken = await b.claim(1, 0)
    assert taken.outcome is Outcome.TAKEN and taken.holder == "a" and taken.run_here
    held = await c.claim(1, 0)  # b is alive: nobody else runs it a third time
    assert held.outcome is Outcome.HELD and held.holder == "b"


async def test_a_restart_with_the_same_id_takes_its_predecessors_prompts_at_once(
    redis_client: aioredis.Redis, unique_name: str
) -> None:
    before = worker(redis_client, unique_name, "w-1")
    await before.heartbeat()
    assert (await before.claim(0, 3)).outcome is Outcome.RUN
    after = worker(redis_client, unique_name, "w-1")  # a new process, same rollout.worker_id
    await after.heartbeat()
    assert after.incarnation != before.incarnation
    assert (await after.claim(0, 3)).outcome is Outcome.TAKEN  # no wait for the old key to expire


async def test_a_released_claim_runs_again_at_once_and_a_retired_worker_counts_as_gone(
    redis_client: aioredis.Redis, unique_name: str
) -> None:
    a, b = worker(redis_client, unique_name, "a"), worker(redis_client, unique_name, "b")
    await a.heartbeat()
    await b.heartbeat()
    for offset in (0, 1):
        assert (await a.claim(0, offset)).outcome is Outcome.RUN
    await a.release(0, 0)  # cancelled at the end of a graceful stop
    assert (await b.claim(0, 0)).outcome is Outcome.RUN
    await b.release(0, 1)  # not b's claim: nothing happens
    assert (await b.claim(0, 1)).outcome is Outcome.HELD
    await a.retire()
    assert (await b.claim(0, 1)).outcome is Outcome.TAKEN


async def test_without_redis_a_claim_is_unknown_at_once_not_a_wait(unique_name: str) -> None:
    """A worker whose Redis is gone is told at once (None) and keeps its GPU busy."""
    gone = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    try:
        claims = worker(gone, unique_name, "a")
        assert await asyncio.wait_for(claims.claim(0, 0), 10) is None
        await asyncio.wait_for(claims.release(0, 0), 10)  # logged, not raised
    finally:
        await gone.aclose()


async def test_a_worker_starting_while_redis_is_down_waits_for_it(unique_name: str, tmp_path: Path) -> None:
    """Its first heartbeat waits Redis out (a chaos run saw a worker exit when Redis restarted
    just as it started)."""
    with LocalRedisServer(tmp_path / "redis") as redis:
        client = aioredis.from_url(redis.url)
        try:
            a = worker(client, unique_name, "a")
            redis.stop()
            starting = asyncio.create_task(a.register())
            await asyncio.sleep(1.0)
            assert not starting.done()  # waiting, not failed
            redis.start()
            await asyncio.wait_for(starting, 30)
            assert await client.get(RedisKeys(unique_name, "t0").key("worker:a")) == a.incarnation.encode()
        finally:
            await client.aclose()

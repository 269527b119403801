"""Prompt claims against a real Redis: who runs a prompt record, and when it may run again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from harness.waits import within
from rollstream.dev.redis_server import LocalRedisServer
from rollstream.rollout_workers.claims import DuplicateWorkerId, Outcome, PromptClaims
from rollstream.state.client import RedisKeys


pytestmark = pytest.mark.broker

REC = "1700000000000:p:0:0"  # a record's identity (timestamp:key)
WINDOW = 10.0  # the default failure detection time: how long a new redis-server process is not settled


@pytest.fixture(autouse=True)
async def settled(redis_client: aioredis.Redis) -> None:
    """The session's Redis has served for a window: absences are trusted on it (a Redis that
    just started may be one that came back empty; see claim_scripts)."""
    uptime = (await redis_client.info("server"))["uptime_in_seconds"]
    await asyncio.sleep(max(0.0, WINDOW + 0.5 - uptime))


def worker(client: aioredis.Redis, name: str, worker_id: str, detection: float = 10.0) -> PromptClaims:
    return PromptClaims(client, RedisKeys(name, "t0"), worker_id, detection)


async def test_a_prompt_runs_once_while_its_worker_lives(redis_client: aioredis.Redis, unique_name: str) -> None:
    a, b = worker(redis_client, unique_name, "a"), worker(redis_client, unique_name, "b")
    await a.register()
    await b.register()
    assert (await a.claim(0, 7, REC)).outcome is Outcome.RUN
    assert (await a.claim(0, 7, REC)).outcome is Outcome.MINE  # read again by the same process
    held = await b.claim(0, 7, REC)
    assert held.outcome is Outcome.HELD and held.holder == "a" and not held.run_here
    a.done(0, 7, REC)  # written as soon as Redis answers
    await a._flush()
    assert (await b.claim(0, 7, REC)).outcome is Outcome.DONE
    a.forget(0, [7])  # an offset commit passed it: the claim is deleted
    await a._flush()
    assert not await redis_client.exists(RedisKeys(unique_name, "t0").key("claim:0:7"))


async def test_a_claim_of_another_record_at_the_same_offset_is_no_claim(
    redis_client: aioredis.Redis, unique_name: str
) -> None:
    """A recreated topic starts its offsets again: an old claim (even a done one) does not
    speak for the new record at that offset."""
    a, b = worker(redis_client, unique_name, "a"), worker(redis_client, unique_name, "b")
    await a.register()
    await b.register()
    assert (await a.claim(0, 0, REC)).outcome is Outcome.RUN
    a.done(0, 0, REC)
    await a._flush()
    assert (await b.claim(0, 0, "1800000000000:p:0:0")).outcome is Outcome.RUN


async def test_a_dead_workers_prompts_are_taken_over_once(redis_client: aioredis.Redis, unique_name: str) -> None:
    a = worker(redis_client, unique_name, "a", detection=1.0)
    b, c = worker(redis_client, unique_name, "b"), worker(redis_client, unique_name, "c")
    for w in (a, b, c):
        await w.register()
    assert (await a.claim(1, 0, REC)).outcome is Outcome.RUN
    assert (await b.claim(1, 0, REC)).outcome is Outcome.HELD
    await asyncio.sleep(1.3)  # a stops renewing: its liveness expires after failure_detection_seconds
    taken = await b.claim(1, 0, REC)
    assert taken.outcome is Outcome.TAKEN and taken.holder == "a" and taken.run_here
    held = await c.claim(1, 0, REC)  # b is alive: nobody else runs it a third time
    assert held.outcome is Outcome.HELD and held.holder == "b"


async def test_a_worker_with_a_live_workers_id_is_refused_and_a_crashed_ones_successor_takes_over(
    redis_client: aioredis.Redis, unique_name: str
) -> None:
    first = worker(redis_client, unique_name, "w-1", detection=3.0)
    await first.register()
    assert (await first.claim(0, 3, REC)).outcome is Outcome.RUN
    alive = asyncio.create_task(first.maintain())
    try:
        second = worker(redis_client, unique_name, "w-1", detection=3.0)
        with pytest.raises(DuplicateWorkerId, match="in use by a live worker"):
            await within(second.register(), 10, "the second worker's registration")
    finally:
        alive.cancel()
        await asyncio.gather(alive, return_exceptions=True)
    # the first one crashes (no more renewals): a restart with its id takes its prompts over
    after = worker(redis_client, unique_name, "w-1", detection=3.0)
    await within(after.register(), 10, "the successor's registration")
    assert (await after.claim(0, 3, REC)).outcome is Outcome.TAKEN  # no wait for the old key to expire
    with pytest.raises(DuplicateWorkerId, match="taken over"):
        await first.heartbeat()  # had it only stalled: it finds its id taken and stops


async def test_a_released_claim_runs_again_at_once_and_a_retired_worker_counts_as_gone(
    redis_client: aioredis.Redis, unique_name: str
) -> None:
    a, b = worker(redis_client, unique_name, "a"), worker(redis_client, unique_name, "b")
    await a.register()
    await b.register()
    for offset in (0, 1):
        assert (await a.claim(0, offset, REC)).outcome is Outcome.RUN
    await a.release(0, 0)  # cancelled at the end of a graceful stop
    assert (await b.claim(0, 0, REC)).outcome is Outcome.RUN
    await b.release(0, 1)  # not b's claim: nothing happens
    assert (await b.claim(0, 1, REC)).outcome is Outcome.HELD
    await a.retire()
    assert (await b.claim(0, 1, REC)).outcome is Outcome.TAKEN


async def test_without_redis_a_claim_is_unknown_at_once_and_absences_are_not_trusted_after_it(
    tmp_path: Path, unique_name: str
) -> None:
    """A worker whose Redis is gone is told at once (None); once Redis answers again, an
    absence is not trusted for one failure-detection time (live workers write their claims
    again meanwhile): a claim in that time is UNSURE, never RUN."""
    with LocalRedisServer(tmp_path / "redis") as redis:
        client = aioredis.from_url(redis.url, socket_connect_timeout=0.5)
        try:
            claims = worker(client, unique_name, "a", detection=1.5)
            await claims.register()
            redis.stop()
            assert await within(claims.claim(0, 0, REC), 10, "a claim without Redis") is None
            await within(claims.release(0, 0), 10, "a release without Redis")  # logged, not raised
            redis.start()  # empty: a new process
            assert (await claims.claim(0, 0, REC)).outcome is Outcome.UNSURE
            await asyncio.sleep(1.6)
            assert (await claims.claim(0, 0, REC)).outcome is Outcome.RUN
        finally:
            await client.aclose()


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
            value = await client.get(RedisKeys(unique_name, "t0").key("worker:a"))
            assert value.decode().startswith(a.incarnation + "|")
        finally:
            await client.aclose()


async def test_a_claim_whose_answer_was_lost_is_released_once_its_partition_moved_away(
    tmp_path: Path, unique_name: str
) -> None:
    """Redis frozen past the client's timeout runs the queued claim when it wakes: worker a,
    told nothing (None), holds a claim it does not know of, and b finds the record HELD by a
    live worker that will never run it. Once a stops asking (its partition moved to b), a
    releases it and b runs the record, instead of waiting for as long as a lives."""
    with LocalRedisServer(tmp_path / "redis") as redis:
        impatient = aioredis.from_url(redis.url, socket_timeout=0.5)
        client = aioredis.from_url(redis.url)
        a, b = worker(impatient, unique_name, "a", detection=3.0), worker(client, unique_name, "b", detection=3.0)
        beats = None
        try:
            await a.register()
            await b.register()
            beats = asyncio.create_task(a.maintain())
            await asyncio.sleep(3.1)  # the new redis-server process is settled for the claims
            assert (await a.claim(0, 2, REC)).outcome is Outcome.RUN  # the script is in Redis's cache
            redis.pause()
            try:
                assert await within(a.claim(0, 3, REC), 10, "a claim to a frozen Redis") is None
            finally:
                redis.resume()
            key = RedisKeys(unique_name, "t0").key("claim:0:3")
            for _ in range(50):  # the queued script ran when Redis woke
                if await client.hget(key, "worker") == b"a":
                    break
                await asyncio.sleep(0.1)
            held = await b.claim(0, 3, REC)
            assert held is not None and held.outcome is Outcome.HELD and held.holder == "a"
            a.abandon(0, 3)  # the partition moved to b
            for _ in range(50):
                claim = await b.claim(0, 3, REC)
                if claim is not None and claim.outcome is Outcome.RUN:
                    break
                await asyncio.sleep(0.1)
            assert claim is not None and claim.outcome is Outcome.RUN
        finally:
            if beats is not None:
                beats.cancel()
                await within(asyncio.gather(beats, return_exceptions=True), 10, "a's heartbeats")
            await impatient.aclose()
            await client.aclose()

"""The sync owners against the real Redis and SGLang stand-ins.

Leases: one owner at a time, fencing tokens that only grow, a stale owner that can neither
renew nor write. Owners: of three competing for a server exactly one loads each version; a
graceful stop hands the server over; a takeover releases a server its predecessor left paused;
a failed load resumes the server and is retried; the pause is bounded; an owner, and the
follower of shared servers, stop when cancelled even if a Redis call loses the cancellation.
(A SIGKILLed owner is in tests/faults/test_sglang_faults.py.) Every wait is bounded and names
its step when it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from harness.fake_sglang import FakeSGLangServer
from harness.waits import until, within
from rollstream.api.engine import WeightUpdate
from rollstream.config import ServerConfig
from rollstream.engines.server_http import ServerHttp
from rollstream.engines.sglang import SGLangEngine
from rollstream.engines.server_admin import time_epoch
from rollstream.engines.sglang_admin import SGLangAdmin
from rollstream.rollout_workers.weight_sync import SyncCandidate, SharedServerFollower, WeightSync
from rollstream.state.client import RedisKeys
from rollstream.state.server_lease import Lease, ServerLeases, ServerSyncState
from rollstream.state.version_store import VersionStore


pytestmark = [pytest.mark.broker, pytest.mark.timeout(90)]

SETTINGS = ServerConfig(lease_ttl_seconds=1.5, reconcile_seconds=0.3, pause_timeout_seconds=2.0,
                        health_probe_timeout_seconds=2.0)
# For tests that are not about leases: with 1.5 s a process starved of CPU for ~1 s lost its
# lease mid-update and the update ran again (seen at load average 27 on two cores).
STEADY = msgspec.structs.replace(SETTINGS, lease_ttl_seconds=10.0)


@pytest.fixture
async def admin() -> AsyncIterator[SGLangAdmin]:
    http = ServerHttp(SETTINGS)
    yield SGLangAdmin(http)
    await http.close()


def leases(client: aioredis.Redis, name: str, owner: str, ttl: float = SETTINGS.lease_ttl_seconds) -> ServerLeases:
    return ServerLeases(client, RedisKeys(name, "t0"), owner, ttl)


async def test_one_holder_growing_tokens_and_stale_owners_fenced(redis_client: aioredis.Redis, unique_name: str) -> None:
    a, b = leases(redis_client, unique_name, "a"), leases(redis_client, unique_name, "b")
    url = "http://gpu0:30000"
    first = await a.acquire(url)
    assert first is not None and await b.acquire(url) is None
    again = await a.acquire(url)  # the holder acquiring again renews, same token
    assert again is not None and again.token == first.token and await a.renew(first)
    await a.release(first)
    second = await b.acquire(url)
    assert second is not None and second.token > first.token
    assert await a.holder(url) == ("b", second.token)
    stale = first
    stale.lost = False  # even a holder that missed the release cannot act with its old token
    assert not await a.renew(stale) and stale.lost
    state = ServerSyncState(url=url, owner="a", token=first.token, phase="serving", version=1)
    assert not await a.write_state(first, state)
    assert await b.write_state(second, ServerSyncState(url=url, owner="b", token=second.token, phase="serving"))
    assert (await a.states())[url].owner == "b"


async def test_an_expired_lease_goes_to_the_next_owner(redis_client: aioredis.Redis, unique_name: str) -> None:
    a, b = leases(redis_client, unique_name, "a", ttl=0.3), leases(redis_client, unique_name, "b", ttl=0.3)
    held = await a.acquire("http://s")
    assert held is not None and held.valid()
    await asyncio.sleep(0.35)  # a crashed: no renewal
    assert not held.valid()  # its own view ended no later than Redis's
    taken = await b.acquire("http://s")
    assert taken is not None and taken.token > held.token


@contextlib.asynccontextmanager
async def owners(server: FakeSGLangServer, admin: SGLangAdmin, client: aioredis.Redis, name: str,
                 n: int = 3, settings: ServerConfig = STEADY,
                 ) -> AsyncIterator[list[tuple[SyncCandidate, asyncio.Task[None]]]]:
    running = []
    for i in range(n):
        owner = SyncCandidate(server.url, admin, leases(client, name, f"w{i}", settings.lease_ttl_seconds), settings)
        running.append((owner, asyncio.create_task(owner.run())))
    try:
        yield running
    finally:
        for _, task in running:
            task.cancel()
        await within(asyncio.gather(*(t for _, t in running), return_exceptions=True), 10, "stopping the owners")


def holders(running: list[tuple[SyncCandidate, asyncio.Task[None]]]) -> list[SyncCandidate]:
    return [o for o, t in running if o.lease is not None and o.lease.valid() and not t.done()]


async def test_exactly_one_of_three_owners_loads_each_version(
    admin: SGLangAdmin, redis_client: aioredis.Redis, unique_name: str
) -> None:
    async with FakeSGLangServer(token_delay=0.005) as server, \
            owners(server, admin, redis_client, unique_name) as running:
        await until(lambda: len(holders(running)) == 1, "one lease holder")
        for version in (1, 2, 3):
            for owner, _ in running:
                owner.offer(WeightUpdate(version, f"/ckpt/v{version}"))
            await until(lambda: server.version == version and not server.paused,
                        f"the server running on v{version}")
        await asyncio.sleep(3 * SETTINGS.reconcile_seconds)  # reconciles load nothing more
        assert [load.version for load in server.loads] == [1, 2, 3]
        assert server.hits["pause"] == 3 and sum(o.loads for o, _ in running) == 3
        states = await within(leases(redis_client, unique_name, "reader").states(), 5, "reading the states")
        assert states[server.url].phase == "serving" and states[server.url].version == 3


async def test_graceful_stop_hands_over_and_the_successor_releases_a_paused_server(
    admin: SGLangAdmin, redis_client: aioredis.Redis, unique_name: str
) -> None:
    async with FakeSGLangServer(token_delay=0.005) as server, \
            owners(server, admin, redis_client, unique_name, settings=SETTINGS) as running:
        await until(lambda: len(holders(running)) == 1, "one lease holder")
        (first,) = holders(running)
        await within(admin.pause(server.url, first.lease.token), 5, "pausing the server")  # as if its owner died right after its pause
        task = next(t for o, t in running if o is first)
        task.cancel()  # a graceful stop releases the lease at once
        await within(asyncio.gather(task, return_exceptions=True), 5, "stopping the first owner")
        await until(lambda: len(holders(running)) == 1 and holders(running)[0] is not first,
                    "another lease holder", timeout=5)
        await until(lambda: not server.paused, "the successor continuing the server", timeout=5)
        assert server.loads == []


async def test_failed_load_resumes_the_server_and_is_retried(
    admin: SGLangAdmin, redis_client: aioredis.Redis, unique_name: str
) -> None:
    async with FakeSGLangServer(token_delay=0.005) as server, \
            owners(server, admin, redis_client, unique_name, n=1) as running:
        owner = running[0][0]
        server.fail_updates = True
        owner.offer(WeightUpdate(1, "/ckpt/v1"))
        await until(lambda: server.hits["update"] >= 2, "a second load (the retry)")
        await until(lambda: not server.paused, "the server running")  # and never left paused meanwhile
        assert owner.failed_loads >= 2 and server.weight_version == "default"
        server.fail_updates = False
        await until(lambda: server.version == 1 and not server.paused, "the server running on v1")
        assert len(server.loads) == 1


async def test_the_pause_is_bounded(admin: SGLangAdmin, redis_client: aioredis.Redis, unique_name: str) -> None:
    """A server whose pause does not answer in pause_timeout_seconds: the owner gives up on
    this try, continues the server and retries later, instead of hanging; the request the pause
    aborted gets its answer; the owner stops when told to."""
    async with FakeSGLangServer(token_delay=0.02, pause_poll_seconds=30.0) as server:
        http = ServerHttp(SETTINGS)
        try:
            generating = asyncio.create_task(http.post(server.url, "/generate", {
                "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 500}}, 60))
            await until(lambda: server.tokens_out > 0, "the request generating")
            async with owners(server, admin, redis_client, unique_name, n=1) as running:
                owner = running[0][0]
                started = time.monotonic()
                owner.offer(WeightUpdate(1, "/ckpt/v1"))
                await until(lambda: owner.failed_loads >= 1, "the owner giving up on the pause", timeout=10)
                assert time.monotonic() - started < SETTINGS.pause_timeout_seconds + 3
                # its continue waits for the server's pause lock (held by the 30 s poll): stop it there
                await until(lambda: server.hits["continue"] >= 1, "the owner continuing the server", timeout=5)
            answer = await within(generating, 5, "the aborted request's answer")
            assert answer["meta_info"]["finish_reason"]["type"] == "abort"
        finally:
            await within(http.close(), 5, "closing the client")
    assert server.handlers_running == 0  # the 30 s pause poll ended with the server


async def test_a_stray_pause_is_continued_by_the_owner(
    admin: SGLangAdmin, redis_client: aioredis.Redis, unique_name: str
) -> None:
    """Something else pauses a server (a frozen predecessor's late call): the owner's reconcile
    sees it up but not generating while no update runs, and continues it."""
    async with FakeSGLangServer(token_delay=0.005, health_pause_timeout=30.0) as server, \
            owners(server, admin, redis_client, unique_name, n=1) as running:
        await until(lambda: len(holders(running)) == 1 and server.hits["continue"] == 1,
                    "the takeover's own continue")
        await within(admin.pause(server.url, time_epoch()), 5, "pausing the server")
        await until(lambda: not server.paused, "the owner continuing the server",
                    timeout=3 * SETTINGS.health_probe_timeout_seconds)
        assert server.hits["continue"] == 2 and server.loads == []


async def lose_the_cancellation(answered: asyncio.Event) -> None:
    """Set ``answered``, wait to be cancelled and return normally: what redis-py 8 does on Python
    3.11 when a cancellation arrives just after Redis answered. It sends every command through
    ``asyncio.wait_for``, which then returns the finished result instead of raising (bpo-42130,
    fixed in 3.12)."""
    answered.set()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.Event().wait()


class LossyLeases(ServerLeases):
    """Leases whose first ``lossy`` call (acquire, renew or write_state) loses the cancellation
    (``lose_the_cancellation``); ``answered`` is set while that call waits for it."""

    def __init__(self, client: aioredis.Redis, name: str, lossy: str) -> None:
        super().__init__(client, RedisKeys(name, "t0"), "w0", ttl_seconds=9.0)
        self.lossy = lossy
        self.answered = asyncio.Event()

    async def acquire(self, url: str) -> Lease | None:
        return await self._answer("acquire", await super().acquire(url))

    async def renew(self, lease: Lease) -> bool:
        return await self._answer("renew", await super().renew(lease))

    async def write_state(self, lease: Lease, state: ServerSyncState) -> bool:
        return await self._answer("write_state", await super().write_state(lease, state))

    async def _answer(self, call: str, answer: Any) -> Any:
        if call == self.lossy and not self.answered.is_set():
            await lose_the_cancellation(self.answered)
        return answer


@pytest.mark.parametrize("lossy, update", [
    ("acquire", False), ("renew", False), ("write_state", False), ("write_state", True)])
async def test_an_owner_stops_even_when_redis_loses_the_cancellation(
    lossy: str, update: bool, admin: SGLangAdmin, redis_client: aioredis.Redis, unique_name: str
) -> None:
    """A rollout worker stops its owners by cancelling them. The cancellation lands during a
    Redis call that drops it (``LossyLeases``): the owner still stops at once and releases its
    lease, instead of renewing it (or serving) on until its lease expires, or forever. With an
    update to do, the lost cancellation lands as it records "pausing": it pauses nothing."""
    async with FakeSGLangServer(token_delay=0.005) as server:
        leases = LossyLeases(redis_client, unique_name, lossy)
        owner = SyncCandidate(server.url, admin, leases, SETTINGS)
        if update:
            owner.offer(WeightUpdate(1, "/ckpt/v1"))
        task = asyncio.create_task(owner.run())
        try:
            await within(leases.answered.wait(), 10, f"the owner's first {lossy}")
            task.cancel()
            await within(asyncio.wait({task}), 3, f"the owner stopping after its {lossy} lost the cancellation")
        finally:
            task.cancel()  # a second cancellation always lands (the first was the lost one)
            await within(asyncio.gather(task, return_exceptions=True), 5, "stopping the owner")
        assert task.cancelled()
        assert await within(leases.holder(server.url), 5, "reading the lease") is None
        assert server.hits["pause"] == 0 and not server.paused


class LossyStore(VersionStore):
    """A version store whose next ``lossy`` call (get_version or get_update) after ``arm()``
    loses the cancellation (``lose_the_cancellation``); ``answered`` is set meanwhile."""

    def __init__(self, client: aioredis.Redis, name: str, lossy: str) -> None:
        super().__init__(client, RedisKeys(name, "t0"))
        self.lossy, self.armed = lossy, False
        self.answered = asyncio.Event()

    def arm(self) -> None:
        self.armed = True

    async def get_version(self) -> int:
        return await self._answer("get_version", await super().get_version())

    async def get_update(self, version: int | None = None) -> WeightUpdate | None:
        return await self._answer("get_update", await super().get_update(version))

    async def _answer(self, call: str, answer: Any) -> Any:
        if call == self.lossy and self.armed and not self.answered.is_set():
            await lose_the_cancellation(self.answered)
        return answer


@pytest.mark.parametrize("lossy", ["get_version", "get_update"])
async def test_a_follower_stops_even_when_redis_loses_the_cancellation(
    lossy: str, redis_client: aioredis.Redis, unique_name: str
) -> None:
    """A rollout worker on shared servers stops its follower (version watch, version apply,
    server owners) by cancelling it. The cancellation lands in the watch's poll of the version
    (get_version) or in the apply's read of the weights (get_update), which drop it: the
    follower still stops at once, instead of polling on, or waiting for the next version."""
    async with FakeSGLangServer(token_delay=0.005) as server:
        engine = SGLangEngine([server.url], settings=STEADY)
        store = LossyStore(redis_client, unique_name, lossy)
        sync = WeightSync([server.url], engine.admin, leases(redis_client, unique_name, "w0", 10.0), STEADY)
        follower = SharedServerFollower(engine, store, sync, poll_seconds=0.05)
        task = asyncio.create_task(follower.run())
        try:
            await within(store.publish(WeightUpdate(1, "/ckpt/v1")), 5, "publishing v1")
            await until(lambda: server.version == 1 and not server.paused, "the server running on v1")
            store.arm()
            await within(store.publish(WeightUpdate(2, "/ckpt/v2")), 5, "publishing v2")
            await within(store.answered.wait(), 10, f"the follower's next {lossy}")
            task.cancel()
            await within(asyncio.wait({task}), 3, f"the follower stopping after its {lossy} lost the cancellation")
        finally:
            task.cancel()  # a second cancellation always lands (the first was the lost one)
            await within(asyncio.gather(task, return_exceptions=True), 5, "stopping the follower")
            await within(engine.close(), 5, "closing the engine")
        assert task.cancelled()

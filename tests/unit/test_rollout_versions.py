"""VersionFollower and startup loading against a small in-memory version source.

The real VersionStore (Redis) is exercised by the integration tests; here a fake of the
narrow ``VersionSource`` protocol lets us script outages and failing loads.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from rollstream.api.engine import WeightUpdate
from rollstream.rollout_workers.engine_factory import load_current_version
from rollstream.rollout_workers.versions import VersionFollower
from tests.unit.fakes import FakeEngine


class FakeSource:
    """Versions published with ``publish``; ``down`` makes every call raise like a lost Redis."""

    def __init__(self) -> None:
        self.version = 0
        self.paths: dict[int, str] = {}
        self.down = False
        self._changed = asyncio.Event()
        self.watch_calls = 0

    def publish(self, version: int, path: str | None = "/w") -> None:
        if path is not None:
            self.paths[version] = path
        self.version = version
        self._changed.set()

    def _check(self) -> None:
        if self.down:
            raise RedisConnectionError("connection refused")

    async def get_update(self, version: int | None = None) -> WeightUpdate | None:
        self._check()
        v = self.version if version is None else version
        return WeightUpdate(v, self.paths[v]) if v in self.paths else None

    async def watch(self, poll_seconds: float = 2.0) -> AsyncIterator[int]:
        self.watch_calls += 1
        self._check()
        last = self.version
        yield last
        while True:
            try:
                await asyncio.wait_for(self._changed.wait(), poll_seconds)
            except asyncio.TimeoutError:
                pass
            self._changed.clear()
            self._check()
            if self.version != last:
                last = self.version
                yield last


class RecordingEngine(FakeEngine):
    def __init__(self, fail_loads: int = 0) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.fail_loads = fail_loads
        self.paused = False

    async def pause(self) -> None:
        self.paused = True
        self.calls.append("pause")

    async def resume(self) -> None:
        self.paused = False
        self.calls.append("resume")

    async def update_weights(self, update: WeightUpdate) -> None:
        self.calls.append(f"update:{update.version}")
        if self.fail_loads:
            self.fail_loads -= 1
            raise OSError(f"cannot read {update.path}")


async def _until(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def _follower(engine: RecordingEngine, source: FakeSource) -> VersionFollower:
    return VersionFollower(engine, source, poll_seconds=0.05, backoff_first=0.01, backoff_cap=0.05)


async def _running(follower: VersionFollower) -> asyncio.Task[None]:
    task = asyncio.create_task(follower.run())
    await asyncio.sleep(0)
    return task


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_new_version_pauses_loads_and_resumes() -> None:
    engine, source = RecordingEngine(), FakeSource()
    task = await _running(_follower(engine, source))
    source.publish(1)
    await _until(lambda: engine.get_version() == 1)
    assert engine.calls == ["pause", "update:1", "resume"]
    source.publish(3)
    await _until(lambda: engine.get_version() == 3)
    assert not engine.paused
    await _stop(task)


async def test_failed_load_is_retried_and_generation_resumes_meanwhile() -> None:
    engine, source = RecordingEngine(fail_loads=2), FakeSource()
    follower = _follower(engine, source)
    task = await _running(follower)
    source.publish(1)
    await _until(lambda: engine.get_version() == 1)
    assert [c for c in engine.calls if c.startswith("update")] == ["update:1"] * 3
    for i, call in enumerate(engine.calls):  # every pause is followed by a resume after the load
        if call == "pause":
            assert engine.calls[i + 1 : i + 3] == ["update:1", "resume"]
    assert follower.failed_loads == 2 and not engine.paused
    await _stop(task)


async def test_redis_outage_keeps_version_and_reconnects() -> None:
    engine, source = RecordingEngine(), FakeSource()
    source.publish(1)
    task = await _running(_follower(engine, source))
    await _until(lambda: engine.get_version() == 1)
    source.down = True
    await _until(lambda: source.watch_calls >= 3)  # retrying with backoff, not crashing
    assert not task.done() and engine.get_version() == 1
    source.down = False
    source.publish(2)
    await _until(lambda: engine.get_version() == 2)
    await _stop(task)


async def test_version_without_weights_is_skipped_and_older_versions_ignored() -> None:
    engine, source = RecordingEngine(), FakeSource()
    task = await _running(_follower(engine, source))
    source.publish(1, path=None)
    await asyncio.sleep(0.2)
    assert engine.get_version() == 0 and engine.calls == []
    source.publish(2)
    await _until(lambda: engine.get_version() == 2)
    source.publish(1)  # going back is ignored
    await asyncio.sleep(0.2)
    assert engine.get_version() == 2
    await _stop(task)


async def test_unexpected_errors_reach_the_owner() -> None:
    class Broken(FakeSource):
        async def watch(self, poll_seconds: float = 2.0) -> AsyncIterator[int]:
            raise RuntimeError("bug")
            yield 0  # pragma: no cover

    with pytest.raises(RuntimeError, match="bug"):
        await asyncio.wait_for(_follower(RecordingEngine(), Broken()).run(), 5)


async def test_load_current_version_at_start() -> None:
    engine, source = RecordingEngine(), FakeSource()
    assert await load_current_version(engine, source) == 0
    assert engine.calls == []
    source.publish(4)
    assert await load_current_version(engine, source) == 4
    assert engine.get_version() == 4 and engine.calls == ["pause", "update:4", "resume"]


async def test_load_current_version_failure_raises_and_resumes() -> None:
    engine, source = RecordingEngine(fail_loads=1), FakeSource()
    source.publish(2)
    with pytest.raises(OSError):
        await load_current_version(engine, source)
    assert not engine.paused and engine.get_version() == 0

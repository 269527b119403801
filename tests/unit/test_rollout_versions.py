"""VersionFollower and startup loading against a small in-memory version source.

The real VersionStore (Redis) is exercised by the integration tests; here a fake of the
narrow ``VersionSource`` protocol lets us script outages and failing loads.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from harness.fakes import FakeSource, RecordingEngine, until_true
from rollstream.rollout_workers.engine_factory import load_current_version
from rollstream.retry import RetryPolicy
from rollstream.rollout_workers.version_follower import VersionFollower


def _follower(engine: RecordingEngine, source: FakeSource) -> VersionFollower:
    return VersionFollower(engine, source, poll_seconds=0.05,
                           retry=RetryPolicy(initial=0.01, maximum=0.05, jitter=0.0))


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
    await until_true(lambda: engine.get_version() == 1)
    assert engine.calls == ["pause", "update:1", "resume"]
    source.publish(3)
    await until_true(lambda: engine.get_version() == 3)
    assert not engine.paused
    await _stop(task)


async def test_failed_load_is_retried_and_generation_resumes_meanwhile() -> None:
    engine, source = RecordingEngine(fail_loads=2), FakeSource()
    follower = _follower(engine, source)
    task = await _running(follower)
    source.publish(1)
    await until_true(lambda: engine.get_version() == 1)
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
    await until_true(lambda: engine.get_version() == 1)
    source.down = True
    await until_true(lambda: source.watch_calls >= 3)  # retrying with backoff, not crashing
    assert not task.done() and engine.get_version() == 1
    source.down = False
    source.publish(2)
    await until_true(lambda: engine.get_version() == 2)
    await _stop(task)


async def test_version_without_weights_is_skipped_and_older_versions_ignored() -> None:
    engine, source = RecordingEngine(), FakeSource()
    task = await _running(_follower(engine, source))
    source.publish(1, path=None)
    await asyncio.sleep(0.2)
    assert engine.get_version() == 0 and engine.calls == []
    source.publish(2)
    await until_true(lambda: engine.get_version() == 2)
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

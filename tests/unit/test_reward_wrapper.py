"""AsyncRewardWrapper and its process pool: results, timeouts, retries, isolation of a call that kills
its process, chunks per process, picklability."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy
import pytest

from rollstream.rewards import wrapper as reward_wrapper
from rollstream.rewards.pool import RewardTimeout
from rollstream.rewards.pool_worker import PackedIds
from rollstream.rewards.wrapper import AsyncRewardWrapper
from tests.unit import reward_fns

pytestmark = pytest.mark.timeout(120)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture
async def wrappers() -> AsyncIterator[list[AsyncRewardWrapper]]:
    """Wrappers created by a test, all closed afterwards (so the test's pools never outlive it;
    a pool another test's workflow still holds is left as it was)."""
    before = dict(reward_wrapper._pools)
    made: list[AsyncRewardWrapper] = []
    yield made
    for w in made:
        await w.aclose()
    assert reward_wrapper._pools == before


def make(made: list[AsyncRewardWrapper], fn: object, **kw: object) -> AsyncRewardWrapper:
    w = AsyncRewardWrapper(fn, max_workers=kw.pop("max_workers", 1), **kw)  # type: ignore[arg-type]
    made.append(w)
    return w


async def test_returns_float_result_from_worker_process(wrappers: list[AsyncRewardWrapper]) -> None:
    w = make(wrappers, reward_fns.add)
    result = await w(1, b=2)
    assert result == 3.0 and isinstance(result, float)
    results = await asyncio.gather(*(w(i, i) for i in range(5)))
    assert results == [0.0, 2.0, 4.0, 6.0, 8.0]


async def test_pools_are_shared_per_size_and_closed_on_last_release(wrappers: list[AsyncRewardWrapper]) -> None:
    a, b = make(wrappers, reward_fns.worker_pid), make(wrappers, reward_fns.worker_pid)
    assert await a() == await b()  # one worker process serves both
    assert reward_wrapper._pools[1].refcount == 2
    await a.aclose()
    assert reward_wrapper._pools[1].refcount == 1
    with pytest.raises(RuntimeError, match="closed"):
        await a()
    await b.aclose()
    assert 1 not in reward_wrapper._pools


async def test_timeout_on_every_attempt_gives_zero(
    wrappers: list[AsyncRewardWrapper], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    counter = tmp_path / "attempts"
    w = make(wrappers, reward_fns.sleepy, timeout_seconds=0.5, max_retries=2)
    with caplog.at_level(logging.WARNING, logger="rollstream.rewards.wrapper"):
        result = await w(str(counter), 30.0)
    assert result == 0.0 and isinstance(result, float)
    assert lines(counter) == 3  # max_retries=2 -> 3 attempts
    assert "timed out after 0.5 s on all 3 attempts" in caplog.text
    # the hung workers were terminated with their pool, so the wrapper still works at once
    started = time.monotonic()
    assert await w(str(counter), 0.0) == 1.0
    assert time.monotonic() - started < 5.0


async def test_call_raises_the_named_timeout_where_the_wrapper_gives_zero(
    wrappers: list[AsyncRewardWrapper], tmp_path: Path
) -> None:
    """``call`` is the same call without the reference's 0.0: the last attempt's timeout is a
    ``RewardTimeout`` (what the reward tier's ``on_timeout`` decides about), a TimeoutError."""
    counter = tmp_path / "attempts"
    w = make(wrappers, reward_fns.sleepy, timeout_seconds=0.5, max_retries=1)
    with pytest.raises(RewardTimeout, match="timed out after 0.5 s on all 2 attempts") as raised:
        await w.call(str(counter), 30.0)
    assert isinstance(raised.value, TimeoutError) and lines(counter) == 2
    assert await w.call(str(counter), 0.0) == 1.0  # a genuine result, as from the wrapper


async def test_a_timeout_kills_only_its_own_process(wrappers: list[AsyncRewardWrapper], tmp_path: Path) -> None:
    hung, slow = tmp_path / "hung", tmp_path / "slow"
    hanging = make(wrappers, reward_fns.sleepy, timeout_seconds=0.5, max_retries=0, max_workers=2)
    patient = make(wrappers, reward_fns.sleepy, timeout_seconds=10.0, max_retries=0, max_workers=2)
    results = await asyncio.gather(hanging(str(hung), 30.0), patient(str(slow), 1.5))
    assert results == [0.0, 1.0]
    assert lines(slow) == 1  # the other process ran its call undisturbed, on its only attempt


async def test_calls_queued_behind_a_hang_run_elsewhere_without_using_an_attempt(
    wrappers: list[AsyncRewardWrapper], tmp_path: Path
) -> None:
    hung, quick = tmp_path / "hung", tmp_path / "quick"
    hanging = make(wrappers, reward_fns.sleepy, timeout_seconds=0.5, max_retries=0)
    patient = make(wrappers, reward_fns.sleepy, timeout_seconds=10.0, max_retries=0)  # one attempt each
    # one worker process: the three quick calls are queued in it behind the hanging one
    results = await asyncio.gather(hanging(str(hung), 30.0), *(patient(str(quick), 0.0) for _ in range(3)))
    assert results == [0.0, 1.0, 1.0, 1.0]
    assert lines(hung) == 1 and lines(quick) == 3  # each quick call ran exactly once


async def test_timeout_counts_from_the_start_of_the_call(wrappers: list[AsyncRewardWrapper], tmp_path: Path) -> None:
    counter = tmp_path / "runs"
    w = make(wrappers, reward_fns.sleepy, timeout_seconds=2.0, max_retries=0)
    # one process runs them in turn: 3 x 0.8 s > 2 s, but none runs longer than 2 s itself
    assert await asyncio.gather(*(w(str(counter), 0.8) for _ in range(3))) == [1.0, 1.0, 1.0]
    assert lines(counter) == 3


async def test_a_call_that_kills_its_process_fails_alone(wrappers: list[AsyncRewardWrapper], tmp_path: Path) -> None:
    from concurrent.futures.process import BrokenProcessPool

    counter = tmp_path / "attempts"
    poison = make(wrappers, reward_fns.always_killed, max_retries=1)
    good = make(wrappers, reward_fns.add, max_retries=0)  # no attempt to spare
    calls = [good(i, 1) for i in range(3)] + [poison(str(counter))] + [good(i, 10) for i in range(3)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert results[:3] == [1.0, 2.0, 3.0] and results[4:] == [10.0, 11.0, 12.0]
    assert isinstance(results[3], BrokenProcessPool) and "always_killed" in str(results[3])
    assert lines(counter) == 2  # its own two attempts, each killing a process


async def test_concurrent_calls_leave_in_one_chunk_per_process(wrappers: list[AsyncRewardWrapper]) -> None:
    w = make(wrappers, reward_fns.add, max_workers=2)
    await asyncio.gather(w(0, 0), w(0, 0))  # both processes started
    pool = reward_wrapper._pools[2]
    before = pool.chunks_sent
    assert await asyncio.gather(*(w(i, 1) for i in range(16))) == [float(i + 1) for i in range(16)]
    assert pool.chunks_sent - before == 2


def test_a_pool_serves_one_event_loop_after_another() -> None:
    w = AsyncRewardWrapper(reward_fns.worker_pid, max_workers=1)
    try:
        first = asyncio.run(w())
        second = asyncio.run(w())
    finally:
        asyncio.run(w.aclose())
    assert first != second  # the finished loop's process was not reused ...
    with pytest.raises(ProcessLookupError):
        os.kill(int(first), 0)  # ... but killed and reaped


async def test_an_idle_process_that_died_is_replaced(wrappers: list[AsyncRewardWrapper]) -> None:
    w = make(wrappers, reward_fns.worker_pid, max_retries=0)
    pid = int(await w())
    os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(0.5)  # its socket closes; the pool notices
    assert int(await w()) != pid


async def test_other_exceptions_are_retried_then_raised(wrappers: list[AsyncRewardWrapper], tmp_path: Path) -> None:
    counter = tmp_path / "attempts"
    w = make(wrappers, reward_fns.always_fails, max_retries=3)
    with pytest.raises(ValueError, match="reward exploded") as raised:
        await w(str(counter))
    assert lines(counter) == 4
    assert "always_fails" in str(raised.value.__cause__)  # the worker's traceback


async def test_exceptions_that_cannot_cross_become_runtime_errors(wrappers: list[AsyncRewardWrapper]) -> None:
    w = make(wrappers, reward_fns.raises_unrebuildable, max_retries=0)
    with pytest.raises(RuntimeError, match="NeedsTwoArgs: left and right"):
        await w()
    exits = make(wrappers, reward_fns.calls_sys_exit, max_retries=0)
    with pytest.raises(RuntimeError, match="SystemExit"):  # never a SystemExit in this process
        await exits()


@pytest.mark.parametrize("dtype", [numpy.int32, numpy.int64, numpy.uint16, numpy.dtype(">i4")])
async def test_packed_ids_arrive_as_a_list_of_ints(wrappers: list[AsyncRewardWrapper], dtype: object) -> None:
    w = make(wrappers, reward_fns.list_sum, max_retries=0)
    ids = numpy.arange(0, 3000, 3).astype(dtype)
    assert await w(PackedIds(ids)) == float(sum(range(0, 3000, 3)))
    assert await w(PackedIds(ids[::2])) == float(sum(range(0, 3000, 6)))  # not contiguous


async def test_transient_exception_recovers(wrappers: list[AsyncRewardWrapper], tmp_path: Path) -> None:
    counter = tmp_path / "attempts"
    w = make(wrappers, reward_fns.fails_then_succeeds, max_retries=2)
    assert await w(str(counter), 2) == 0.75
    assert lines(counter) == 3


async def test_pool_rebuilt_after_worker_is_killed(wrappers: list[AsyncRewardWrapper], tmp_path: Path) -> None:
    marker = tmp_path / "killed"
    w = make(wrappers, reward_fns.killed_once)
    assert await w(str(marker)) == 1.0
    assert marker.exists()
    assert await w(str(marker)) == 1.0


async def test_broken_pool_on_last_attempt_is_raised(wrappers: list[AsyncRewardWrapper], tmp_path: Path) -> None:
    from concurrent.futures.process import BrokenProcessPool

    counter = tmp_path / "attempts"
    w = make(wrappers, reward_fns.always_killed, max_retries=1)
    with pytest.raises(BrokenProcessPool):
        await w(str(counter))
    assert lines(counter) == 2


def _local_reward() -> float:
    return 1.0


@pytest.mark.parametrize("fn", [lambda: 1.0, (lambda: (lambda x: x))()], ids=["lambda", "local"])
def test_unpicklable_function_is_refused(fn: object) -> None:
    before = dict(reward_wrapper._pools)
    with pytest.raises(TypeError, match="must be picklable"):
        AsyncRewardWrapper(fn)  # type: ignore[arg-type]
    assert reward_wrapper._pools == before  # refused before it took a share of any pool


def test_async_function_and_bad_settings_are_refused() -> None:
    async def coro_fn() -> float:
        return 1.0

    with pytest.raises(TypeError, match="synchronous"):
        AsyncRewardWrapper(coro_fn)
    with pytest.raises(ValueError, match="timeout_seconds"):
        AsyncRewardWrapper(reward_fns.add, timeout_seconds=0)
    with pytest.raises(ValueError, match="max_retries"):
        AsyncRewardWrapper(reward_fns.add, max_retries=-1)


def test_workers_are_never_forked() -> None:
    assert reward_wrapper.START_METHOD in ("forkserver", "spawn")

"""Bounded waits that name the step that did not finish, the stop of a background task, and
the stop of tiers run in this process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar


T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float, step: str) -> T:
    """``await awaitable``, or fail naming ``step`` once ``seconds`` passed (it is then cancelled).
    A ``TimeoutError`` the awaitable raises itself propagates unchanged."""
    bound = asyncio.timeout(seconds)
    try:
        async with bound:
            return await awaitable
    except TimeoutError:
        if bound.expired():
            raise AssertionError(f"{step}: not done within {seconds:g}s") from None
        raise


async def until(predicate: Callable[[], Any], what: str, timeout: float = 20.0,
                logs: Callable[[], str] = lambda: "") -> None:
    """Poll ``predicate`` every 10 ms; fail naming ``what`` (and showing ``logs()``) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{logs()}"
        await asyncio.sleep(0.01)


async def stop_in_process_tiers(tiers: list, stop, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """Set ``stop`` and wait for tier tasks run in this process; each must end by itself,
    without an error, within ``timeout``."""
    stop.set()
    done, pending = await asyncio.wait(tiers, timeout=timeout)
    for tier in pending:
        tier.cancel()
    assert not pending, "a tier did not stop when asked"
    errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
    assert not errors, errors


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60.0) -> None:
    """Poll the coroutine ``check`` every 0.2 s until it answers True; fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def stop_task(task: asyncio.Future[Any], what: str, seconds: float = 30.0) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling it again every second: a library
    can swallow a cancellation and the task's loop then carries on (redis-py 8 on Python 3.11,
    see ``rollstream.runtime.tasks.raise_if_cancelled``; the cluster test's Redis watcher once
    held its test that way until the test's timeout). Fails naming ``what`` when the task has
    not ended within ``seconds``. Whatever the task raised is not re-raised."""
    deadline = time.monotonic() + seconds
    while not task.done():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not stop within {seconds:g}s of being cancelled")
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" at exit

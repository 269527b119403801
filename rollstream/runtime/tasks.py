"""Run several never-ending coroutines as one: the first error ends them all and is raised;
cancel tasks and wait for them;
and make a never-ending loop stop when cancelled even if a library lost the cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


async def run_together(coroutines: dict[str, Coroutine[Any, Any, Any]]) -> None:
    """Run ``coroutines`` (name -> coroutine) as tasks until one raises (re-raised here) or
    this is cancelled; either way every task is cancelled and awaited before returning."""
    tasks = [asyncio.create_task(coro, name=name) for name, coro in coroutines.items()]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        await cancel_and_wait(*tasks)


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel ``tasks`` and wait until every one has ended (what they raise is not raised here)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if the running task was cancelled but carries on regardless.

    Python 3.11's ``asyncio.wait_for`` returns its finished result when the cancellation arrives
    just after the awaited call completed, dropping the cancellation (bpo-42130, fixed in
    3.12), and redis-py 8 sends every command through it (``socket_timeout`` defaults to 5 s).
    The task still counts the request (``Task.cancelling()``). A never-ending loop calls this
    after each such call, so that cancelling it always ends it. Not for ``finally`` blocks: a
    task that runs its clean-up after a cancellation counts the request too.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; True when it is set. ``asyncio.timeout``,
    not ``wait_for``: a cancellation that meets the timeout is never swallowed (Python 3.11)."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True

"""Waits that always end: a call that must not hold its caller forever gets a deadline.

``asyncio.wait_for`` cancels its call at the deadline and then WAITS for the cancellation to
finish; a call that swallows its cancellation holds ``wait_for`` forever. aiokafka's consumer
``stop()`` did exactly that on the 3-node cluster (its fetcher's close awaits a routine whose
cancellation is swallowed), and a test hung for 600 s. :func:`within` waits on the call as a
task of its own and, at the deadline, cancels it and leaves it behind (kept referenced until
it ends, never awaited), so the caller always gets control back, with
:class:`DeadlineExceeded` naming what it waited for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_left_behind: set[asyncio.Future[Any]] = set()  # calls past their deadline, referenced until they end


class DeadlineExceeded(TimeoutError):
    """A bounded wait ran out; the message names what was waited for and for how long."""


class CancelledInside(RuntimeError):
    """The call ended with a cancellation its caller did not ask for: a library re-raised the
    cancellation of a task of its own (aiokafka's consumer ``stop()`` does, when its fetcher's
    close cancels a fetch that is backing off and awaits it). Raised as an error, so that the
    caller, which was not cancelled, is not taken for cancelled and torn down."""


def left_behind() -> int:
    """How many calls are still running after their deadline (for tests and logs)."""
    return len(_left_behind)


def _leave(task: asyncio.Future[Any]) -> None:
    task.cancel()
    _left_behind.add(task)
    task.add_done_callback(_forget)


def _forget(task: asyncio.Future[Any]) -> None:
    _left_behind.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.debug("a call left behind at its deadline failed later: %r", task.exception())


async def within(call: Awaitable[T], seconds: float, what: str) -> T:
    """``await call``, at most ``seconds``; :class:`DeadlineExceeded` ("``what`` did not end
    within Ns") when it runs longer, the call then cancelled and left behind, not awaited.
    A cancellation of the caller cancels the call the same way. A call that ends cancelled on
    its own raises :class:`CancelledInside`, never ``CancelledError``."""
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        _leave(task)
        raise
    if not done:
        _leave(task)
        raise DeadlineExceeded(f"{what} did not end within {seconds:.0f}s")
    if task.cancelled():
        raise CancelledInside(f"{what} ended cancelled, though nothing cancelled it from outside")
    return task.result()

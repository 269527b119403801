"""The whole shutdown of a tier, bounded: from the moment ``stop`` is set, the tier has
``bound`` seconds to end. Each step of a shutdown has its own deadline already (stopping a
client, a commit's retries); this bounds their sum and whatever has none, such as a client
call that hangs on a broker that stopped answering.

At ``bound - UNWIND_SECONDS`` the tier's task is cancelled, the log naming what it was doing
(its phase); :class:`ShutdownTimeout` follows once it unwound, or at the bound. In a tier
process, :class:`~rollstream.runtime.shutdown.ShutdownSignal` ends the process at the bound
even when the event loop itself is stuck.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any


log = logging.getLogger(__name__)

UNWIND_SECONDS = 2.0  # at most this long at the end of the bound for a cancelled tier to unwind


class ShutdownTimeout(TimeoutError):
    """A tier did not end within its shutdown bound; the message names what it was doing."""


async def bounded_by_stop(work: Coroutine[Any, Any, Any], stop: asyncio.Event, bound: float,
                          phase: Callable[[], str], name: str) -> Any:
    """``await work``; once ``stop`` is set, at most ``bound`` seconds more (module docstring)."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            unwind = min(UNWIND_SECONDS, bound / 4)
            done, _ = await asyncio.wait({task}, timeout=bound - unwind)
            if not done:
                await _cancel(task, unwind, name, phase(), bound)
        return task.result()
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        stopping.cancel()


async def _cancel(task: asyncio.Future[Any], unwind: float, name: str, what: str, bound: float) -> None:
    log.error("%s is still %s %.0f s after the stop was asked (shutdown bound %.0f s): cancelled",
              name, what, bound - unwind, bound)
    task.cancel()
    started = time.monotonic()
    await asyncio.wait({task}, timeout=unwind)
    if task.done() and not task.cancelled():
        task.exception()  # what the cancelled task raised is not the news: the timeout is
    raise ShutdownTimeout(f"{name} did not stop within {bound:.0f} s of the stop; it was {what} "
                          f"({'unwound' if task.done() else 'still unwinding'} after {time.monotonic() - started:.1f} s)")

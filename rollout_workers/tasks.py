"""A set of background tasks whose failures are never lost.

Every task spawned here is referenced until it ends. The first exception of any task is kept
and re-raised by :meth:`TaskSet.raise_if_failed` in the loop of the TaskSet's holder, so a dead background
task stops the worker loudly instead of disappearing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from rollstream.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class TaskSet:
    """Owns background tasks: spawn, watch for failures, wait with a deadline, cancel."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.error: BaseException | None = None  # the first exception of any task

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self.error is None:
            log.error("background task %s failed: %s: %s", task.get_name(), type(exc).__name__, exc)
            self.error = exc

    def __len__(self) -> int:
        return len(self._tasks)

    def raise_if_failed(self) -> None:
        """Re-raise the first exception of any task spawned here."""
        if self.error is not None:
            raise self.error

    async def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every task to end; True when all ended."""
        if not self._tasks:
            return True
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        return not pending

    async def cancel_all(self) -> None:
        """Cancel every task still running and wait until they have all ended."""
        await cancel_and_wait(*self._tasks)

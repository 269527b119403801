"""Admission of training prompts through the shared staleness budget in Redis.

A training prompt is published only after ``StalenessBudget.try_admit`` said yes; admission
is idempotent per task id, so a producer that crashed between admitting and publishing
re-admits the same (deterministic) task id without counting it twice. Eval prompts are never
counted. While Redis is unreachable the producer waits: it never publishes an unadmitted
training prompt.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from rollstream.redis_state import StalenessBudget, wait_for_redis

log = logging.getLogger(__name__)

REDIS_ERRORS = (aioredis.ConnectionError, aioredis.TimeoutError, OSError)


class Admission:
    """Asks the staleness budget for room, waiting (not spinning) while there is none.

    ``stop`` interrupts every wait; the methods then return False.
    """

    def __init__(
        self,
        budget: StalenessBudget,
        client: aioredis.Redis,
        poll_seconds: float,
        stop: asyncio.Event,
        enabled: bool = True,
    ) -> None:
        self._budget = budget
        self._client = client
        self._poll_seconds = poll_seconds
        self._stop = stop
        self._enabled = enabled
        self.waits = 0  # how many times the producer waited for room (a counter for logs)

    async def try_admit(self, task_id: str, is_eval: bool) -> bool:
        """True when ``task_id`` is admitted now (always for eval prompts or a disabled budget).

        False when the budget is full right now, or when ``stop`` was set while Redis was
        unreachable. Redis outages are waited out here.
        """
        if is_eval or not self._enabled:
            return True
        while not self._stop.is_set():
            try:
                return await self._budget.try_admit(task_id)
            except REDIS_ERRORS as exc:
                log.warning("staleness budget unreachable while admitting %s: %s", task_id, exc)
                if not await self._wait_for_redis():
                    return False
        return False

    async def wait_for_room(self) -> bool:
        """Sleep until the budget may have grown (new version, a release) or ``poll_seconds``.

        Returns False when ``stop`` was set meanwhile.
        """
        self.waits += 1
        room = asyncio.ensure_future(self._wait_for_room_once())
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({room, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (room, stopped):
                task.cancel()
            await asyncio.gather(room, stopped, return_exceptions=True)
        if room.done() and not room.cancelled() and room.exception() is not None:
            raise room.exception()  # type: ignore[misc]
        return not self._stop.is_set()

    async def _wait_for_room_once(self) -> None:
        try:
            await self._budget.wait_for_room(timeout=self._poll_seconds)
        except REDIS_ERRORS as exc:
            log.warning("staleness budget unreachable while waiting for room: %s", exc)
            await self._wait_for_redis()

    async def _wait_for_redis(self) -> bool:
        """Wait until Redis answers again; False when ``stop`` was set first."""
        try:
            await wait_for_redis(self._client, self._stop)
        except asyncio.CancelledError:
            # wait_for_redis signals "stop was set" with CancelledError; a real cancellation
            # of this task must still propagate.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            return False
        return True

"""Admission of training prompts through the shared staleness budget in Redis.

A training prompt is published only after ``StalenessBudget.try_admit`` said yes; admission
is idempotent per task id, so a producer that crashed between admitting and publishing
re-admits the same (deterministic) task id without counting it twice. Eval prompts are never
counted.

Every admission names the budget *generation* the producer read before it (re)started its
transactional producer (:meth:`Admission.begin`). A rebuild of the counters (Redis lost them,
or came back with an earlier moment's) writes a new generation and fences every producer's
transactional id first, so prompts admitted in the old generation and not committed yet can
never be committed: the producer learns it (:class:`BudgetRebuilt`, from an admission, from
:meth:`Admission.check` inside each transaction, or from a fenced commit) and starts again
from its committed cursor, re-admitting those prompts in the new generation
(docs/GUARANTEES.md, sections 2 and 16). Eval producers count nothing but are fenced by a
rebuild too, so they read the generation as well: it is how a fenced commit tells a rebuild
from a second process with the same producer id.

Redis faults are waited out, never crashes, and never an unadmitted training prompt:
unreachable -> wait for Redis; state missing or stale -> rebuild it from the topics (``restore``);
a malformed key -> log and retry every ``poll_seconds`` until someone fixes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis

from rollstream.runtime.tasks import cancel_and_wait, wait_event
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import GenerationChanged, RedisStateError, StateMissingError, wait_for_redis

log = logging.getLogger(__name__)

REDIS_ERRORS = (aioredis.RedisError, OSError)
T = TypeVar("T")
NO_GENERATION = "none"  # matches no generation: the first admission learns the current one


class BudgetRebuilt(RuntimeError):
    """The staleness budget was rebuilt since this producer (re)started: what it admitted and
    has not committed may be unknown to the new counters, and its transactional producer was
    fenced by the rebuild. Start again from the committed cursor (:meth:`Admission.begin`)."""


class Admission:
    """Asks the staleness budget for room, waiting (not spinning) while there is none.

    ``stop`` interrupts every wait; the methods then return False. ``enabled``: the trial has a
    staleness budget at all; ``counts``: this producer's prompts are counted (train prompts).
    """

    def __init__(
        self,
        budget: StalenessBudget,
        client: aioredis.Redis,
        poll_seconds: float,
        stop: asyncio.Event,
        enabled: bool = True,
        restore: Callable[[], Awaitable[None]] | None = None,
        counts: bool = True,
    ) -> None:
        self._budget = budget
        self._client = client
        self._poll_seconds = poll_seconds
        self._stop = stop
        self._enabled = enabled
        self._counts = counts
        self._restore = restore
        self.generation = NO_GENERATION  # the budget generation this run admits in
        self.waits = 0  # how many times the producer waited for room (a counter for logs)

    async def begin(self) -> None:
        """Read the budget's generation (rebuilding a missing state first); call it BEFORE
        starting the transactional producer: a rebuild after this read fences that producer
        and changes the generation."""
        if not self._enabled:
            return
        generation = await self._with_redis(self._budget.generation, "reading its generation")
        if generation is None and self._restore is not None and not self._stop.is_set():
            await self._restore()
            generation = await self._with_redis(self._budget.generation, "reading its generation")
        self.generation = generation or NO_GENERATION

    async def try_admit(self, task_id: str, is_eval: bool) -> bool:
        """True when ``task_id`` is admitted now (always for eval prompts or a disabled budget).

        False when the budget is full right now, or when ``stop`` was set while Redis could
        not answer. Redis faults are waited out here. Raises :class:`BudgetRebuilt`.
        """
        if is_eval or not self._enabled or not self._counts:
            return True
        try:
            admitted = await self._with_redis(
                lambda: self._budget.try_admit(task_id, self.generation), f"admitting {task_id}"
            )
        except GenerationChanged as exc:
            raise BudgetRebuilt(f"{exc} since this producer started") from exc
        return bool(admitted)

    async def check(self) -> None:
        """Raise :class:`BudgetRebuilt` unless the generation is still the one this run admits
        in; call it inside each transaction, before sending (after the producer started)."""
        if not self._enabled:
            return
        current = await self._with_redis(self._budget.generation, "checking its generation")
        if current != self.generation:
            raise BudgetRebuilt(f"the staleness budget's generation is {current or 'unknown'}, not {self.generation}")

    async def rebuilt(self) -> bool:
        """Whether the budget was rebuilt since :meth:`begin` (a fenced commit asks: a rebuild
        fences every producer; anything else that fences one is a second process with its id)."""
        if not self._enabled:
            return False
        return await self._with_redis(self._budget.generation, "checking its generation") != self.generation

    async def _with_redis(self, call: Callable[[], Awaitable[T]], what: str) -> T | None:
        """``await call()`` through every Redis fault; None when a fault meets ``stop`` set."""
        while True:
            try:
                return await call()
            except StateMissingError:
                if self._restore is None:
                    raise
                if self._stop.is_set():
                    return None
                try:
                    await self._restore()
                except REDIS_ERRORS as exc:  # Redis went away again during the rebuild
                    log.warning("rebuilding the staleness budget failed: %s", exc)
                    if not await wait_for_redis(self._client, self._stop):
                        return None
            except RedisStateError as exc:
                log.error("staleness budget unusable while %s: %s; retrying in %.1fs", what, exc, self._poll_seconds)
                if self._stop.is_set():
                    return None
                await wait_event(self._stop, self._poll_seconds)
            except REDIS_ERRORS as exc:
                log.warning("staleness budget unreachable while %s: %s", what, exc)
                if not await wait_for_redis(self._client, self._stop):
                    return None

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
            await cancel_and_wait(room, stopped)
        if room.done() and not room.cancelled() and room.exception() is not None:
            raise room.exception()  # type: ignore[misc]
        return not self._stop.is_set()

    async def _wait_for_room_once(self) -> None:
        try:
            await self._budget.wait_for_room(timeout=self._poll_seconds)
        except REDIS_ERRORS as exc:
            log.warning("staleness budget unreachable while waiting for room: %s", exc)
            await wait_for_redis(self._client, self._stop)

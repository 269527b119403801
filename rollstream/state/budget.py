"""The staleness budget in Redis: admission control across any number of producers.

Admission and release are idempotent per task id: a producer that retries after a crash, or a
grouping consumer that re-decides a group after a restart, never counts a prompt twice. The
counters live in one hash whose stamp (a *generation*, new at every rebuild, and the *epoch*,
the redis-server process it was built on: ``rollstream.state.epoch``) is written only by
:meth:`StalenessBudget.restore`. Admissions and releases refuse to count while the state is
missing (a Redis without persistence restarted: ``StateMissingError``) or was written on
another process (a restart from a snapshot, an AOF that lost its last second, a failover to
a lagging replica: ``StateStaleError``); a producer then rebuilds the counters from the topics
(``rollstream.producers.budget_restore``). An admission names the generation its producer's
uncommitted admissions were counted in, and is refused with
:class:`~rollstream.state.client.GenerationChanged` when that generation is gone, so no
producer commits a prompt that the current counters never counted (docs/GUARANTEES.md,
sections 2 and 16).

The capacity uses ``max(version, version_floor)``: the trainer's version in Redis, or the
version the rebuild proved the trainer had reached (the newest trainer version tagged on
``batches``) when Redis holds an older one.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from rollstream.state import budget_scripts as scripts
from rollstream.state.client import MARKER_TTL_SECONDS, RedisKeys, parse_int, script_answer

CHUNK = 1000  # markers per pipeline round trip in a rebuild


class RebuildInterrupted(RuntimeError):
    """The rebuild lost its lock, or Redis changed process under it: start it again."""


@dataclass
class RebuiltCounts:
    """What a rebuild read from the durable facts (see ``rollstream.producers.budget_restore``)."""

    admitted: list[str] = field(default_factory=list)  # committed train task ids (their markers)
    drops: dict[str, str] = field(default_factory=dict)  # task id -> reason, of those
    admitted_count: int = 0  # counted as admitted when above len(admitted) (cursors: retention)
    version_floor: int = 0  # a version the trainer is known to have reached
    trainer_dropped: int = 0  # groups the trainer dropped as stale (its committed count)
    note: str = ""


@dataclass(frozen=True)
class BudgetUsage:
    """One consistent reading of the budget (one script)."""

    admitted: int
    dropped: int
    trainer_dropped: int
    version: int  # the trainer's version key
    version_floor: int
    capacity: int
    state: str  # "valid", "missing" or "stale"

    @property
    def in_use(self) -> int:
        """What the bound compares with the capacity: admitted minus every returned slot."""
        return self.admitted - self.dropped - self.trainer_dropped


_STATES = {1: "valid", -2: "missing", -5: "stale"}


class StalenessBudget:
    """Admission control across any number of producers, counted in prompts (groups).

    A prompt is admitted only while ``admitted - dropped - trainer_dropped < (eta + v + 1) *
    groups_per_step`` with ``v = max(version, version_floor)``. Eval prompts never touch the budget.
    Dropped (or fully rejected) groups return their slot, as do groups the trainer drops as stale.
    """

    def __init__(
        self, client: aioredis.Redis, keys: RedisKeys, max_head_offpolicyness: int, groups_per_step: int
    ) -> None:
        self._redis = client
        self._keys = keys
        self._eta = max_head_offpolicyness
        self._groups_per_step = groups_per_step
        self._admit = client.register_script(scripts.ADMIT)
        self._release = client.register_script(scripts.RELEASE)
        self._trainer_drops = client.register_script(scripts.TRAINER_DROPS)
        self._generation = client.register_script(scripts.GENERATION)
        self._usage = client.register_script(scripts.USAGE)
        self._lock = client.register_script(scripts.LOCK)
        self._renew = client.register_script(scripts.RENEW_LOCK)
        self._unlock = client.register_script(scripts.UNLOCK)
        self._restore = client.register_script(scripts.RESTORE)

    @property
    def _state_key(self) -> str:
        return self._keys.key("budget")

    # -- counting --

    async def try_admit(self, task_id: str, generation: str | None = None) -> bool:
        """Admit ``task_id`` if the budget allows (idempotent: a re-admission returns True).

        ``generation``: the budget generation the caller's uncommitted admissions were counted
        in (None: any). Raises :class:`StateMissingError` / :class:`StateStaleError` (rebuild
        first), :class:`GenerationChanged` or :class:`RedisStateError`."""
        k = self._keys.key
        keys = [self._state_key, k("version"), k(f"admit:{task_id}")]
        args = [self._eta, self._groups_per_step, MARKER_TTL_SECONDS, generation or ""]
        return script_answer(await self._admit(keys=keys, args=args)) == 1

    async def release(self, task_id: str, reason: str) -> bool:
        """Return a dropped group's slot and count the drop by reason; idempotent per task
        within a generation. Raises like :meth:`try_admit` while the state is unusable."""
        k = self._keys.key
        keys = [self._state_key, k("drops_by_reason"), k(f"drop:{task_id}"), k(f"admit:{task_id}")]
        return script_answer(await self._release(keys=keys, args=[reason, MARKER_TTL_SECONDS])) == 1

    async def note_trainer_drops(self, cumulative: int) -> None:
        """Record the trainer's cumulative count of groups it dropped as stale (their slots
        return); idempotent, never lowers the count. Raises like :meth:`try_admit`."""
        script_answer(await self._trainer_drops(keys=[self._state_key], args=[cumulative]))

    async def generation(self) -> str | None:
        """The budget's current generation; None while its state is missing or stale."""
        answer = await self._generation(keys=[self._state_key])
        if isinstance(answer, int):
            return None
        return answer.decode() if isinstance(answer, bytes) else str(answer)

    async def has_state(self) -> bool:
        """True when the state exists and was written on the Redis process that holds it now."""
        return await self.generation() is not None

    # -- rebuilding --

    async def lock(self, holder: str, ttl_seconds: float) -> str | None:
        """Take the rebuild lock for ``holder`` (one rebuilder at a time): the epoch it is held on,
        None when another holder holds it on this epoch. Expires after ``ttl_seconds`` unless renewed."""
        answer = await self._lock(keys=[self._keys.key("restore-lock")], args=[holder, int(ttl_seconds * 1000)])
        return answer.decode() if isinstance(answer, bytes) else answer

    async def renew_lock(self, holder: str, ttl_seconds: float) -> bool:
        """Extend the lock; False when ``holder`` no longer holds it on this epoch."""
        return bool(await self._renew(keys=[self._keys.key("restore-lock")], args=[holder, int(ttl_seconds * 1000)]))

    async def unlock(self, holder: str) -> None:
        await self._unlock(keys=[self._keys.key("restore-lock")], args=[holder])

    async def restore(self, counts: RebuiltCounts, lock_holder: str | None = None) -> bool:
        """Write counters rebuilt from the durable facts under a new generation, stamped with
        the epoch of the process that takes them. False (nothing written) when a valid state
        exists already; :class:`RebuildInterrupted` when the lock holder ``lock_holder`` no longer
        holds the lock on this epoch (the markers written here may be on a process that is gone).

        Markers first (valued with the new generation), the counters and the stamp last in one
        script, so no admission or release can count between the two (they refuse until the
        stamp is written)."""
        k = self._keys.key
        generation = uuid.uuid4().hex
        for prefix, items in (("admit", [(t, "") for t in counts.admitted]), ("drop", list(counts.drops.items()))):
            for start in range(0, len(items), CHUNK):
                async with self._redis.pipeline(transaction=False) as pipe:
                    for task_id, _ in items[start:start + CHUNK]:
                        pipe.set(k(f"{prefix}:{task_id}"), generation, ex=MARKER_TTL_SECONDS)
                    await pipe.execute()
        by_reason: dict[str, int] = {}
        for reason in counts.drops.values():
            by_reason[reason] = by_reason.get(reason, 0) + 1
        pairs = [x for reason, n in sorted(by_reason.items()) for x in (reason, n)]
        admitted = max(len(counts.admitted), counts.admitted_count)
        args = [lock_holder or "", admitted, len(counts.drops), generation, counts.version_floor,
                counts.trainer_dropped, time.time(), counts.note, *pairs]
        keys = [self._state_key, k("drops_by_reason"), k("restore-lock")]
        answer = int(await self._restore(keys=keys, args=args))
        if answer == scripts.LOCK_LOST:
            raise RebuildInterrupted("the rebuild lock was lost or Redis changed process during the rebuild")
        return answer == 1

    # -- waiting and reading --

    async def wait_for_room(self, timeout: float) -> None:
        """Sleep until the budget may have grown (a version or a release), at most ``timeout``."""
        pubsub = self._redis.pubsub()
        await pubsub.subscribe(self._keys.channel)
        try:
            await pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
        finally:
            await pubsub.aclose()

    async def notify(self) -> None:
        await self._redis.publish(self._keys.channel, json.dumps({"event": "release"}))

    async def read(self) -> BudgetUsage:
        """The counters, the version and the state's validity in one reading;
        :class:`RedisStateError` naming a key that is not a number."""
        raw = await self._usage(keys=[self._state_key, self._keys.key("version")])
        names = ("admitted", "dropped", "trainer_dropped", "version_floor")
        admitted, dropped, trainer_dropped, floor = (
            parse_int(f"{self._state_key}.{name}", value) for name, value in zip(names, raw[:4]))
        version = parse_int(self._keys.key("version"), raw[4])
        return BudgetUsage(admitted, dropped, trainer_dropped, version, floor,
                           (self._eta + max(version, floor) + 1) * self._groups_per_step, _STATES[int(raw[5])])

    async def usage(self) -> dict[str, int]:
        """Counters for status displays: admitted, dropped, trainer_dropped, in_use, capacity,
        version (see :meth:`read`)."""
        u = await self.read()
        return {"admitted": u.admitted, "dropped": u.dropped, "trainer_dropped": u.trainer_dropped,
                "in_use": u.in_use, "capacity": u.capacity, "version": u.version, "version_floor": u.version_floor}

    async def drops_by_reason(self) -> dict[str, int]:
        raw = await self._redis.hgetall(self._keys.key("drops_by_reason"))
        return {key.decode(): int(value) for key, value in raw.items()}

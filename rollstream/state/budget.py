"""The staleness budget in Redis: admission control across any number of producers.

Admission and release are idempotent per task id: a producer that retries after a crash, or a
grouping consumer that re-decides a group after a restart, never counts a prompt twice. The
budget's counters live under a ``state`` marker that is written only by
:meth:`StalenessBudget.restore` and holds the budget's *generation* (a new random id per
rebuild); a Redis that restarted without persistence has lost the marker with the counters,
so admissions and releases refuse to count (``StateMissingError``) until a producer has
rebuilt the counters from the topics (``rollstream.producers.budget_restore``). An admission
names the generation its producer's uncommitted admissions were counted in, and is refused
with :class:`~rollstream.state.client.GenerationChanged` when that generation is gone, so no
producer commits a prompt that the current counters never counted (docs/GUARANTEES.md,
section 2).
"""

from __future__ import annotations

import json
import time
import uuid

import redis.asyncio as aioredis

from rollstream.state.client import MARKER_TTL_SECONDS, RedisKeys, parse_int, script_answer

# KEYS: admitted, dropped, version, admit marker, state. ARGV: eta, batch size, marker TTL,
# the caller's generation ('' = any). 1 admitted, 0 no room, STATE_MISSING,
# {GENERATION_CHANGED, current}, or {MALFORMED, key, value}.
_ADMIT = """
local generation = redis.call('GET', KEYS[5])
if not generation then return -2 end
if ARGV[4] ~= '' and generation ~= ARGV[4] then return {-4, generation} end
if redis.call('EXISTS', KEYS[4]) == 1 then return 1 end
local values = {}
for i = 1, 3 do
  local raw = redis.call('GET', KEYS[i])
  values[i] = tonumber(raw or '0')
  if values[i] == nil then return {-3, KEYS[i], raw} end
end
local a, d, v = values[1], values[2], values[3]
if a - d < (tonumber(ARGV[1]) + v + 1) * tonumber(ARGV[2]) then
  redis.call('INCR', KEYS[1])
  redis.call('SET', KEYS[4], '1', 'EX', ARGV[3])
  return 1
end
return 0
"""

# KEYS: dropped, drops_by_reason, drop marker, admit marker, state.
_RELEASE = """
if redis.call('EXISTS', KEYS[5]) == 0 then return -2 end
if redis.call('SET', KEYS[3], ARGV[1], 'NX', 'EX', ARGV[2]) then
  if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('INCR', KEYS[1]) end
  redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
  return 1
end
return 0
"""

# KEYS: admitted, dropped, drops_by_reason, state, state info. ARGV: admitted, dropped,
# generation, info, then reason/count pairs. Writes the rebuilt counters unless the state
# exists already.
_RESTORE = """
if redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('DEL', KEYS[3])
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]) end
redis.call('SET', KEYS[5], ARGV[4])
redis.call('SET', KEYS[4], ARGV[3])
return 1
"""



class StalenessBudget:
    """Admission control across any number of producers, counted in prompts (groups).

    A prompt is admitted only while ``admitted - dropped < (eta + version + 1) * batch_size``.
    Eval prompts never touch the budget. Dropped (or fully rejected) groups return their slot.
    """

    def __init__(
        self, client: aioredis.Redis, keys: RedisKeys, max_head_offpolicyness: int, batch_size: int
    ) -> None:
        self._redis = client
        self._keys = keys
        self._eta = max_head_offpolicyness
        self._batch_size = batch_size
        self._admit = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)
        self._restore = client.register_script(_RESTORE)

    def _admit_keys(self, task_id: str) -> list[str]:
        k = self._keys.key
        return [k("admitted"), k("dropped"), k("version"), k(f"admit:{task_id}"), k("state")]

    async def try_admit(self, task_id: str, generation: str | None = None) -> bool:
        """Admit ``task_id`` if the budget allows (idempotent: a re-admission returns True).

        ``generation``: the budget generation the caller's uncommitted admissions were counted
        in (None: any). Raises :class:`StateMissingError` (rebuild first),
        :class:`GenerationChanged` or :class:`RedisStateError`."""
        args = [self._eta, self._batch_size, MARKER_TTL_SECONDS, generation or ""]
        return script_answer(await self._admit(keys=self._admit_keys(task_id), args=args)) == 1

    async def generation(self) -> str | None:
        """The budget's current generation; None while its state is missing."""
        raw = await self._redis.get(self._keys.key("state"))
        return raw.decode() if isinstance(raw, bytes) else raw

    async def release(self, task_id: str, reason: str) -> bool:
        """Return a dropped group's slot and count the drop by reason; idempotent per task."""
        k = self._keys.key
        keys = [k("dropped"), k("drops_by_reason"), k(f"drop:{task_id}"), k(f"admit:{task_id}"), k("state")]
        return script_answer(await self._release(keys=keys, args=[reason, MARKER_TTL_SECONDS])) == 1

    async def has_state(self) -> bool:
        return bool(await self._redis.exists(self._keys.key("state")))

    async def restore(
        self, admitted: list[str], drops: dict[str, str], admitted_count: int | None = None, note: str = ""
    ) -> bool:
        """Write counters rebuilt from the topics: ``admitted`` train task ids (counted as
        ``admitted_count`` when larger, e.g. from producer cursors) and the reasons of the
        ``drops`` among them, under a new generation. False (nothing written) when the state
        exists already.

        Markers first, the counters and the ``state`` marker last in one script, so no
        admission or release can count between the two (they refuse while the state is gone).
        """
        k = self._keys.key
        chunk = 1000
        for start in range(0, len(admitted), chunk):
            async with self._redis.pipeline(transaction=False) as pipe:
                for task_id in admitted[start:start + chunk]:
                    pipe.set(k(f"admit:{task_id}"), "1", ex=MARKER_TTL_SECONDS)
                await pipe.execute()
        items = list(drops.items())
        for start in range(0, len(items), chunk):
            async with self._redis.pipeline(transaction=False) as pipe:
                for task_id, reason in items[start:start + chunk]:
                    pipe.set(k(f"drop:{task_id}"), reason, ex=MARKER_TTL_SECONDS)
                await pipe.execute()
        by_reason: dict[str, int] = {}
        for reason in drops.values():
            by_reason[reason] = by_reason.get(reason, 0) + 1
        pairs = [x for reason, n in sorted(by_reason.items()) for x in (reason, n)]
        count = max(len(admitted), admitted_count or 0)
        generation = uuid.uuid4().hex
        info = json.dumps({"restored_at": time.time(), "generation": generation, "admitted": count,
                           "dropped": len(drops), "note": note})
        keys = [k("admitted"), k("dropped"), k("drops_by_reason"), k("state"), k("state-info")]
        return bool(await self._restore(keys=keys, args=[count, len(drops), generation, info, *pairs]))

    async def try_lock(self, owner: str, ttl_seconds: int) -> bool:
        """Take the rebuild lock (one rebuilder at a time); expires after ``ttl_seconds``."""
        return bool(await self._redis.set(self._keys.key("restore-lock"), owner, nx=True, ex=ttl_seconds))

    async def unlock(self, owner: str) -> None:
        key = self._keys.key("restore-lock")
        if await self._redis.get(key) == owner.encode():
            await self._redis.delete(key)

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

    async def usage(self) -> dict[str, int]:
        """Counters for status displays: admitted, dropped, capacity, version."""
        k = self._keys.key
        names = ("admitted", "dropped", "version")
        raw = await self._redis.mget(*(k(n) for n in names))
        admitted, dropped, v = (parse_int(k(n), value) for n, value in zip(names, raw))
        return {
            "admitted": admitted,
            "dropped": dropped,
            "version": v,
            "capacity": (self._eta + v + 1) * self._batch_size,
        }

    async def drops_by_reason(self) -> dict[str, int]:
        raw = await self._redis.hgetall(self._keys.key("drops_by_reason"))
        return {key.decode(): int(value) for key, value in raw.items()}

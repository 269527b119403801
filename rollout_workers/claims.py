"""Claims on prompt records: which live rollout worker is running which prompt.

The prompts consumer group moves partitions whenever the fleet changes (a worker joins,
leaves, restarts, or dies), and aiokafka rebalances eagerly: every member gives up all its
partitions and the new owner of a partition reads it again from its committed offset, which
lies before every prompt still running anywhere. A claim in Redis says who runs a prompt
record, so whoever reads it again knows whether to run it:

* no claim: nobody runs it; claim it and run it (``RUN``);
* claimed by this very process: it is running here already (``MINE``): it marks the offset
  done when it ends;
* done: every sample of it is published (``DONE``): the offset may be committed;
* claimed by another worker that is alive (``HELD``): wait for it to end (the partition's
  commit point waits at it; later prompts run meanwhile);
* claimed by a worker that is gone (``TAKEN``): the claim is ours now and we run it again.
  Only then is a prompt generated twice.

A worker is alive while its liveness key (``worker:<worker_id>``) holds its incarnation (a
random id per process), renewed every third of ``rollout.failure_detection_seconds``; it
expires that long after the process died. A restarted worker with the same ``worker_id``
overwrites the key at once, so its predecessor's claims are taken over without waiting.

While Redis cannot be reached a record cannot be claimed (:meth:`PromptClaims.claim` answers
None): the worker runs it anyway rather than leave its GPU idle, so a rebalance during a Redis
outage can run a prompt twice (the duplicates are removed downstream); marking a prompt done
waits for Redis, so whoever reads it after the outage finds it done.

Every claim carries the hash tag of the trial's keys (``rollstream.state.client.RedisKeys``),
so each script touches one slot.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis

from rollstream.state.client import RedisKeys
from rollstream.retry import REDIS_RETRY
from rollstream.runtime.tasks import raise_if_cancelled

log = logging.getLogger(__name__)

CLAIM_TTL_SECONDS = 24 * 3600  # a claim outlives any commit lag; it is garbage after that
REDIS_FAULTS = (aioredis.RedisError, OSError)

# KEYS: claim. ARGV: worker, incarnation, ttl. {outcome, holder worker, holder incarnation}
_CLAIM = """
local c = redis.call('HMGET', KEYS[1], 'worker', 'inc', 'state')
if not c[1] then
  redis.call('HSET', KEYS[1], 'worker', ARGV[1], 'inc', ARGV[2], 'state', 'running')
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return {'run', '', ''}
end
if c[3] == 'done' then return {'done', c[1], c[2]} end
if c[1] == ARGV[1] and c[2] == ARGV[2] then return {'mine', c[1], c[2]} end
return {'other', c[1], c[2]}
"""

# KEYS: claim, the holder's liveness key. ARGV: holder worker, holder incarnation, worker,
# incarnation, ttl. Takes the claim over when its holder is gone: {'taken'}, {'held'},
# {'done'}, or {'changed'} (the claim moved meanwhile: ask again).
_TAKE_OVER = """
local c = redis.call('HMGET', KEYS[1], 'worker', 'inc', 'state')
if c[1] ~= ARGV[1] or c[2] ~= ARGV[2] then return {'changed'} end
if c[3] == 'done' then return {'done'} end
if redis.call('GET', KEYS[2]) == ARGV[2] then return {'held'} end
redis.call('HSET', KEYS[1], 'worker', ARGV[3], 'inc', ARGV[4], 'state', 'running')
redis.call('EXPIRE', KEYS[1], ARGV[5])
return {'taken'}
"""

# KEYS: claim. ARGV: worker, incarnation, ttl.
_DONE = """
redis.call('HSET', KEYS[1], 'worker', ARGV[1], 'inc', ARGV[2], 'state', 'done')
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: claim. ARGV: worker, incarnation. Gives up a running claim of ours.
_RELEASE = """
local c = redis.call('HMGET', KEYS[1], 'worker', 'inc', 'state')
if c[1] == ARGV[1] and c[2] == ARGV[2] and c[3] == 'running' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


class Outcome(enum.Enum):
    RUN = "run"  # claimed now: run it
    TAKEN = "taken"  # claimed over a worker that is gone: run it again
    MINE = "mine"  # running in this process already
    DONE = "done"  # finished by someone: commit past it
    HELD = "held"  # running on another live worker: wait for it


@dataclass(frozen=True)
class Claim:
    outcome: Outcome
    holder: str = ""  # the worker that holds (or held) the claim, for logs

    @property
    def run_here(self) -> bool:
        return self.outcome in (Outcome.RUN, Outcome.TAKEN)


class PromptClaims:
    """This worker's side of the claims: liveness, claim, done, release."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, worker_id: str, failure_detection_seconds: float) -> None:
        self._redis = client
        self._keys = keys
        self.worker_id = worker_id
        self.incarnation = uuid.uuid4().hex[:12]
        self._ttl_ms = max(1000, int(failure_detection_seconds * 1000))
        self._claim = client.register_script(_CLAIM)
        self._take_over = client.register_script(_TAKE_OVER)
        self._done = client.register_script(_DONE)
        self._release = client.register_script(_RELEASE)

    def _claim_key(self, partition: int, offset: int) -> str:
        return self._keys.key(f"claim:{partition}:{offset}")

    def _liveness_key(self, worker_id: str) -> str:
        return self._keys.key(f"worker:{worker_id}")

    # -- liveness --

    async def heartbeat(self) -> None:
        """Say this incarnation is alive for the next ``failure_detection_seconds``."""
        previous = await self._redis.set(self._liveness_key(self.worker_id), self.incarnation, px=self._ttl_ms, get=True)
        if previous is not None and previous.decode() != self.incarnation:
            log.warning("worker id %s was held by incarnation %s (a predecessor, or a second worker with this "
                        "rollout.worker_id); its running prompts count as gone", self.worker_id, previous.decode())

    async def register(self) -> None:
        """The first heartbeat, at start: Redis down or restarting is waited out (the shared
        retry policy), not a reason to exit."""
        await REDIS_RETRY.call(self.heartbeat, retry_on=REDIS_FAULTS, what=f"registering worker {self.worker_id}")
        raise_if_cancelled()

    async def keep_alive(self) -> None:
        """Renew the liveness key every third of its lifetime until cancelled; Redis faults
        are logged and retried (a key that expires meanwhile only lets others re-run)."""
        while True:
            try:
                await self.heartbeat()
            except REDIS_FAULTS as exc:
                log.warning("renewing the liveness of worker %s failed: %s", self.worker_id, exc)
            raise_if_cancelled()  # redis-py's wait_for can lose a cancellation (Python 3.11)
            await asyncio.sleep(self._ttl_ms / 3000)

    async def retire(self) -> None:
        """Graceful exit: delete the liveness key if it is still ours (claims left are gone)."""
        key = self._liveness_key(self.worker_id)
        try:
            if await self._redis.get(key) == self.incarnation.encode():
                await self._redis.delete(key)
        except REDIS_FAULTS as exc:
            log.warning("retiring worker %s: %s (its liveness key expires by itself)", self.worker_id, exc)

    # -- claims --

    async def claim(self, partition: int, offset: int) -> Claim | None:
        """Claim the prompt at ``partition``/``offset``, or say who has it (module docstring);
        None while Redis cannot be reached (one try: the caller decides what that means)."""
        try:
            claim = await self._claim_once(partition, offset)
        except REDIS_FAULTS as exc:
            log.warning("cannot claim prompt %d@%d (%s: %s)", partition, offset, type(exc).__name__, exc)
            claim = None
        raise_if_cancelled()
        return claim

    async def done(self, partition: int, offset: int) -> None:
        """Every sample of the prompt is published: whoever reads it again commits past it.
        Waits out Redis faults (the shared retry policy): the offset waits for it."""
        args = [self.worker_id, self.incarnation, CLAIM_TTL_SECONDS]
        await REDIS_RETRY.call(lambda: self._done(keys=[self._claim_key(partition, offset)], args=args),
                               retry_on=REDIS_FAULTS, what=f"marking prompt {partition}@{offset} done")
        raise_if_cancelled()

    async def release(self, partition: int, offset: int) -> None:
        """Give up a running claim of ours (the prompt was cancelled): it runs again at once
        on the partition's owner instead of after this worker's liveness expired. A Redis
        fault leaves that to the liveness key's expiry."""
        args = [self.worker_id, self.incarnation]
        try:
            await self._release(keys=[self._claim_key(partition, offset)], args=args)
        except REDIS_FAULTS as exc:
            log.warning("cannot release the claim of prompt %d@%d (%s)", partition, offset, exc)

    async def _claim_once(self, partition: int, offset: int) -> Claim:
        key = self._claim_key(partition, offset)
        while True:
            outcome, worker, incarnation = _strings(
                await self._claim(keys=[key], args=[self.worker_id, self.incarnation, CLAIM_TTL_SECONDS])
            )
            if outcome != "other":
                return Claim(Outcome(outcome), worker)
            keys = [key, self._liveness_key(worker)]
            args = [worker, incarnation, self.worker_id, self.incarnation, CLAIM_TTL_SECONDS]
            (answer,) = _strings(await self._take_over(keys=keys, args=args))
            if answer != "changed":
                return Claim(Outcome(answer), worker)


def _strings(values: list[bytes | str]) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]

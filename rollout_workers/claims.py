"""Claims on prompt records: which live rollout worker is running which prompt.

The prompts consumer group moves partitions whenever the fleet changes (a worker joins,
leaves, restarts, or dies), and aiokafka rebalances eagerly: every member gives up all its
partitions and each partition's new partition owner reads it again from its committed
offset, which lies before every prompt still running anywhere. A claim in Redis says who runs
a prompt record, so whoever reads it again knows whether to run it:

* no claim: nobody runs it; claim it and run it (``RUN``);
* claimed by this very process: it is running here already (``MINE``);
* done: every sample of it is published (``DONE``): the offset may be committed;
* claimed by another worker that is alive (``HELD``): wait for it to end (the partition's
  commit point waits at it; later prompts run meanwhile);
* claimed by a worker that is gone (``TAKEN``): the claim is ours now and we run it again.
  Only then is a prompt generated twice;
* ``UNSURE``: Redis cannot vouch for an absence yet (below): ask again later.

A worker is alive while its liveness key (``worker:<worker_id>``) holds its incarnation (a
random id per process) on the current redis-server process, renewed every third of
``rollout.failure_detection_seconds``; it expires that long after the process died. A worker
that starts with the id of a worker that is still alive is refused (:class:`DuplicateWorkerId`);
one restarted after a crash takes its predecessor's claims over once the predecessor's key
stopped being renewed.

Redis coming back older (a restart from a snapshot, a lagging replica) or unreachable for a
while can lose claims and liveness keys of workers that are alive and running. So an ABSENCE
(no claim, a holder without liveness) is trusted only when both the worker and the Redis
process are settled (``claim_scripts``: the claims' epoch gate): for
``failure_detection_seconds`` after a worker saw Redis change process, fail or answer slowly,
and after a Redis process first serves the trial's claims, absences answer ``UNSURE``.
Meanwhile every live worker writes what it runs and what it finished again
(:meth:`PromptClaims.maintain`, from :class:`~rollstream.rollout_workers.local_claims.LocalClaims`),
which its next heartbeat does well within that time. While Redis cannot be reached at all, a
worker runs only what its own knowledge allows (``local_claims``); nothing it runs, finishes or
commits waits for Redis: claims it could not write are written once Redis answers, and claims
are deleted once an offset commit passed them.

A claim whose answer was lost (a timeout, a dropped connection) may still have been made:
Redis runs a script it received, whether or not the caller is still waiting (a Redis paused
or slow past the client's timeout runs the queued scripts when it wakes). Such a claim names a
live worker that does not know it holds it, and would keep the record from every other worker
for as long as that worker lives. So the worker remembers every claim it sent without an
answer until a later answer settles it, and releases the ones of records it stops caring
about (its partition moved away) as soon as Redis answers (:meth:`PromptClaims.abandon`).

Every claim carries the hash tag of the trial's keys (``rollstream.state.client.RedisKeys``),
so each script touches one slot, and the identity of its record (timestamp and key), so a
claim of a recreated topic's earlier record is no claim.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiokafka.structs import ConsumerRecord

from rollstream.retry import REDIS_RETRY
from rollstream.rollout_workers import claim_scripts as scripts
from rollstream.rollout_workers.local_claims import LocalClaims
from rollstream.runtime.tasks import raise_if_cancelled, wait_event
from rollstream.state.client import RedisKeys

log = logging.getLogger(__name__)

CLAIM_TTL_SECONDS = 24 * 3600  # a backstop: claims are deleted once committed past
REDIS_FAULTS = (aioredis.RedisError, OSError)
FLUSH_SECONDS = 0.2  # how soon a claim written while Redis answers reaches it
START_MARGIN_SECONDS = 1.0  # beyond one heartbeat: is the worker id's holder still beating?


class Outcome(enum.Enum):
    RUN = "run"  # claimed now: run it
    TAKEN = "taken"  # claimed over a worker that is gone: run it again
    MINE = "mine"  # running in this process already
    DONE = "done"  # finished by someone: commit past it
    HELD = "held"  # running on another live worker: wait for it
    UNSURE = "unsure"  # Redis cannot vouch for an absence yet: ask again


@dataclass(frozen=True)
class Claim:
    outcome: Outcome
    holder: str = ""  # the worker that holds (or held) the claim, for logs

    @property
    def run_here(self) -> bool:
        return self.outcome in (Outcome.RUN, Outcome.TAKEN)


class DuplicateWorkerId(RuntimeError):
    """Another live worker uses this ``rollout.worker_id``."""


def record_identity(record: ConsumerRecord) -> str:
    """What tells one prompt record from another at the same offset (a recreated topic)."""
    key = (record.key or b"").decode("utf-8", "replace")
    return f"{record.timestamp}:{key}"


class PromptClaims:
    """This worker's side of the claims: liveness, claims, and keeping Redis told."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, worker_id: str, failure_detection_seconds: float,
                 local: LocalClaims | None = None) -> None:
        self._redis = client
        self._keys = keys
        self.worker_id = worker_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.local = local or LocalClaims()
        self._window = failure_detection_seconds
        self._window_ms = int(failure_detection_seconds * 1000)
        self._gate_key = keys.key("claims:epoch")
        self._ttl_ms = max(1000, self._window_ms)
        self._beat_seconds = self._ttl_ms / 3000
        self._scripts = {name: client.register_script(getattr(scripts, name)) for name in
                         ("HEARTBEAT", "LIVENESS", "CLAIM", "TAKE_OVER", "ASSERT", "RELEASE", "RETIRE")}
        self.epoch: str | None = None  # the redis-server process last answered by
        self._trust_from = 0.0  # absences trusted from then on (monotonic; see _call)
        self._disrupted = False  # a call failed or was slow, and none succeeded since
        self._registered = False
        self._reassert = False  # write every claim this worker answers for again
        # (partition, offset) -> (state, identity); state "running" | "done" | "release" | "" (delete)
        self._pending: dict[tuple[int, int], tuple[str, str]] = {}
        self._unanswered: dict[tuple[int, int], str] = {}  # claims sent whose answer was lost -> identity
        self._wake = asyncio.Event()

    def _claim_key(self, partition: int, offset: int) -> str:
        return self._keys.key(f"claim:{partition}:{offset}")

    def _liveness_key(self, worker_id: str) -> str:
        return self._keys.key(f"worker:{worker_id}")

    # -- trust: when an absence in Redis means something --

    def trusts(self) -> bool:
        """Absences are trusted: this worker saw no disruption within the last window."""
        return not self._disrupted and time.monotonic() >= self._trust_from

    async def _call(self, name: str, keys: list[str], args: list[object]) -> list[str]:
        """Run a script; its answer as strings. A failure, a slow answer or another epoch than
        the last one are disruptions: Redis may have lost (or not yet have) what live workers
        wrote, so absences are not trusted until they had time to write it again."""
        began = time.monotonic()
        try:
            answer = [v.decode() if isinstance(v, bytes) else str(v) for v in
                      await self._scripts[name](keys=keys, args=args)]
        except REDIS_FAULTS:
            self._disrupted = True
            raise
        now = time.monotonic()
        epoch = answer[-1]
        changed = self.epoch is not None and epoch != self.epoch
        if changed:
            log.warning("Redis changed process (epoch %s, was %s): its claims may be older than the truth",
                        epoch[:8], self.epoch[:8])  # type: ignore[index]
        if self._disrupted or changed or now - began > self._beat_seconds:
            self.disrupted(now)
        self.epoch = epoch
        return answer

    def disrupted(self, now: float | None = None) -> None:
        """Redis may have lost what live workers wrote (it changed process, failed, was slow,
        forgot this worker's liveness): write every claim this worker answers for again, and
        trust no absence for one window."""
        now = time.monotonic() if now is None else now
        self._disrupted, self._reassert = False, True
        self._trust_from = now + self._window
        self._wake.set()

    def _trust_arg(self) -> str:
        return "1" if self.trusts() else "0"

    # -- liveness --

    async def register(self) -> None:
        """At start: refuse to run beside a live worker with this id (:class:`DuplicateWorkerId`),
        then the first heartbeat. Redis down or restarting is waited out (the shared retry
        policy), not a reason to exit."""
        await REDIS_RETRY.call(self._register_once, retry_on=REDIS_FAULTS, what=f"registering worker {self.worker_id}")
        raise_if_cancelled()

    async def _register_once(self) -> None:
        key = self._liveness_key(self.worker_id)
        holder, remaining, _ = await self._call("LIVENESS", [key], [])
        if holder and holder != self.incarnation:
            waited = self._beat_seconds + START_MARGIN_SECONDS
            log.info("worker id %s is held by incarnation %s: waiting %.1fs to see whether it is alive",
                     self.worker_id, holder, waited)
            await asyncio.sleep(waited)
            again, left, _ = await self._call("LIVENESS", [key], [])
            if again == holder and int(left) > int(remaining) - waited * 1000 + 200:  # renewed meanwhile
                raise DuplicateWorkerId(
                    f"rollout.worker_id {self.worker_id!r} is in use by a live worker (incarnation {holder}, "
                    "still renewing its liveness): give each rollout worker its own rollout.worker_id")
            log.warning("worker id %s: incarnation %s stopped renewing its liveness; taking its prompts over",
                        self.worker_id, holder)
        await self._call("HEARTBEAT", [key], [self.incarnation, self._ttl_ms, "1"])
        self._registered = True

    async def heartbeat(self) -> None:
        """Say this incarnation is alive for the next ``failure_detection_seconds``;
        :class:`DuplicateWorkerId` when another live incarnation took the id over (this worker
        was stalled so long that it counted as gone)."""
        outcome, holder, missing, _ = await self._call("HEARTBEAT", [self._liveness_key(self.worker_id)],
                                                       [self.incarnation, self._ttl_ms, "0"])
        if outcome == "other":
            raise DuplicateWorkerId(f"rollout.worker_id {self.worker_id!r} was taken over by incarnation {holder} "
                                    "while this worker did not renew its liveness: this worker stops")
        if missing == "1" and self._registered:
            log.warning("Redis had forgotten the liveness of worker %s: writing its claims again", self.worker_id)
            self.disrupted()
        self._registered = True

    async def maintain(self) -> None:
        """Until cancelled: a heartbeat every third of ``failure_detection_seconds``; after a
        disruption, every claim this worker answers for written again; pending claim writes and
        deletions flushed. Redis faults are logged and retried; :class:`DuplicateWorkerId` ends it."""
        next_beat = 0.0
        while True:
            if time.monotonic() >= next_beat:
                try:
                    await self.heartbeat()
                except REDIS_FAULTS as exc:
                    log.warning("renewing the liveness of worker %s failed: %s", self.worker_id, exc)
                next_beat = time.monotonic() + self._beat_seconds
            try:
                if self._reassert:
                    await self._assert_all()
                await self._flush()
            except REDIS_FAULTS as exc:
                log.warning("writing prompt claims failed (%s); will retry", exc)
            raise_if_cancelled()  # redis-py's wait_for can lose a cancellation (Python 3.11)
            self._wake.clear()
            await wait_event(self._wake, max(0.0, min(FLUSH_SECONDS if self._pending else 3600,
                                                      next_beat - time.monotonic())))

    async def retire(self) -> None:
        """Graceful exit: write what is pending (bounded), delete the liveness key if it is still
        ours (claims left are gone)."""
        try:
            await asyncio.wait_for(self._flush(), 5.0)
            await self._scripts["RETIRE"](keys=[self._liveness_key(self.worker_id)], args=[self.incarnation])
        except (*REDIS_FAULTS, asyncio.TimeoutError) as exc:
            log.warning("retiring worker %s: %s (its liveness key expires by itself)", self.worker_id, exc)

    # -- claims --

    async def claim(self, partition: int, offset: int, identity: str) -> Claim | None:
        """Claim the record at ``partition``/``offset``, or say who has it (module docstring);
        None while Redis cannot be reached (one try: the caller decides what that means; the
        claim may have been made all the same, see :meth:`abandon`)."""
        record = (partition, offset)
        if self._pending.get(record, ("",))[0] == "release":
            del self._pending[record]  # this claim's answer settles it
        try:
            claim = await self._claim_once(partition, offset, identity)
        except REDIS_FAULTS as exc:
            log.warning("cannot claim prompt %d@%d (%s: %s)", partition, offset, type(exc).__name__, exc)
            self._unanswered[record] = identity
            claim = None
        else:
            self._unanswered.pop(record, None)
        raise_if_cancelled()
        return claim

    def abandon(self, partition: int, offset: int) -> None:
        """This worker stops asking about the record (its partition moved away): a claim of
        it sent without an answer, which Redis may have made after all, is released once Redis
        answers, so the new partition owner is not kept waiting by a claim nobody runs."""
        identity = self._unanswered.pop((partition, offset), None)
        if identity is not None:
            log.info("releasing a possible claim of prompt %d@%d (its answer was lost)", partition, offset)
            self._queue(partition, offset, "release", identity)

    async def _claim_once(self, partition: int, offset: int, identity: str) -> Claim:
        key = self._claim_key(partition, offset)
        while True:
            outcome, worker, incarnation, _ = await self._call(
                "CLAIM", [key, self._gate_key],
                [self.worker_id, self.incarnation, CLAIM_TTL_SECONDS, identity, self._trust_arg(), self._window_ms])
            if outcome != "other":
                return Claim(Outcome(outcome), worker)
            keys = [key, self._liveness_key(worker), self._gate_key]
            args = [worker, incarnation, self.worker_id, self.incarnation, CLAIM_TTL_SECONDS, identity,
                    self._trust_arg(), self._window_ms]
            answer, _ = await self._call("TAKE_OVER", keys, args)
            if answer != "changed":
                return Claim(Outcome(answer), worker)

    def running(self, partition: int, offset: int, identity: str) -> None:
        """This worker runs the record without a claim Redis granted (it could not, or could not
        vouch yet): the claim is written as soon as Redis answers."""
        self._queue(partition, offset, "running", identity)

    def done(self, partition: int, offset: int, identity: str) -> None:
        """Every sample of the record is published: the claim says so as soon as Redis answers
        (nothing waits for it: whoever reads the record before finds it running here, alive)."""
        self._queue(partition, offset, "done", identity)

    def forget(self, partition: int, offsets: list[int]) -> None:
        """An offset commit passed these records: their claims are deleted (nobody reads them again)."""
        for offset in offsets:
            self._queue(partition, offset, "", "")

    def _queue(self, partition: int, offset: int, state: str, identity: str) -> None:
        if state != "release":
            self._unanswered.pop((partition, offset), None)  # what this worker writes now settles it
        self._pending[(partition, offset)] = (state, identity)
        self._wake.set()

    async def release(self, partition: int, offset: int) -> None:
        """Give up a running claim of ours (the prompt was cancelled): it runs again at once
        on the partition owner instead of after this worker's liveness expired. A Redis
        fault leaves that to the liveness key's expiry."""
        self._pending.pop((partition, offset), None)
        try:
            await self._scripts["RELEASE"](keys=[self._claim_key(partition, offset)],
                                           args=[self.worker_id, self.incarnation])
        except REDIS_FAULTS as exc:
            log.warning("cannot release the claim of prompt %d@%d (%s)", partition, offset, exc)

    async def _flush(self) -> None:
        """Write the pending claims and deletions (one pipeline); what fails stays pending."""
        if not self._pending:
            return
        batch = dict(self._pending)
        async with self._redis.pipeline(transaction=False) as pipe:
            for (partition, offset), (state, identity) in batch.items():
                key = self._claim_key(partition, offset)
                if state == "release":
                    await self._scripts["RELEASE"](keys=[key], args=[self.worker_id, self.incarnation], client=pipe)
                elif state:
                    await self._scripts["ASSERT"](keys=[key], args=[self.worker_id, self.incarnation,
                                                                    CLAIM_TTL_SECONDS, identity, state], client=pipe)
                else:
                    pipe.delete(key)
            await pipe.execute()
        for item, value in batch.items():
            if self._pending.get(item) == value:
                del self._pending[item]

    async def _assert_all(self) -> None:
        """Write every claim this worker answers for again (Redis may have lost them)."""
        self._reassert = False
        records = self.local.to_assert()
        for tp, offset, identity, finished in records:
            self._pending.setdefault((tp.partition, offset), ("done" if finished else "running", identity))
        if records:
            log.info("writing the claims of %d prompts this worker runs or finished again", len(records))

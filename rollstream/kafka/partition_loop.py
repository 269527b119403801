"""The one consume loop: every consumer of rollstream runs in a :class:`PartitionLoop`.

The loop owns the consumer's poll, the rebalance guard
(:class:`~rollstream.kafka.ownership.PartitionOwnership`), flow control and the order of
things; the delivery guarantee is a parameter, the :class:`Delivery` it runs:

- :class:`~rollstream.kafka.consume_transform_produce.ExactlyOnce`: a tier's ``Transform``
  turns records into output that commits with the input offsets in one Kafka transaction per
  input partition (reward workers, grouping);
- :class:`AtLeastOnce` (below): the tier takes records and sends its own output; the loop
  commits the input offsets the tier says are done, every ``commit_interval`` seconds, when a
  partition moves away, at the end, and when the tier asks (:meth:`AtLeastOnce.commit`)
  (rollout workers, the trainer's source).

One cycle: flow control (while the delivery has no room, the owned partitions are PAUSED and
the poll goes on without fetching, so the consumer keeps its membership during work of any
length), the poll, then under the guard's lock: retry pending takes, keep the records still
owned, hand them to the delivery; then the delivery's ``tick`` outside the lock. When ``stop``
is set the loop runs one final cycle and returns; the consumer stays open (the caller closes
it, or leaves the group first, as the rollout worker does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition

from rollstream.kafka.ownership import PartitionOwnership
from rollstream.retry import RetryPolicy

log = logging.getLogger(__name__)

Records = dict[int, list[ConsumerRecord]]
POSITION_TIMEOUT_SECONDS = 5.0


class Delivery(Protocol):
    """What a loop delivers by: how partitions are taken and given up, how records are
    processed and committed. A subclass inherits ``room``, ``wait_for_room`` and ``tick`` that
    do nothing (no limit, no wait, no periodic work)."""

    def bind(self, loop: PartitionLoop) -> None:
        """The loop this delivery runs in (its consumer, topic and guard)."""

    async def acquire(self, partitions: set[int]) -> set[int]:
        """Take ``partitions`` (before the guard seeks them to their committed offsets);
        returns those taken, the rest are retried."""

    async def release(self, partitions: set[int]) -> None:
        """``partitions`` moved away (or are about to be rebuilt)."""

    def room(self) -> int | None:
        """Records wanted now: None no limit, 0 none (the owned partitions are paused)."""

    async def wait_for_room(self, timeout: float) -> None:
        """Return when there may be room again, or after ``timeout`` seconds; at once when there
        is room already (room made between ``room()`` and this call must not wait out the
        timeout)."""

    async def process(self, records: Records, final: bool) -> float:
        """Records still owned, by partition (called with the guard's lock held); returns the
        seconds to pause before the next poll (0 unless something failed)."""

    async def tick(self, final: bool) -> None:
        """After each cycle, outside the lock (periodic work, failures of background work)."""


class PartitionLoop:
    """Poll, guard, deliver; until ``stop``, then one final cycle (module docstring)."""

    def __init__(
        self, *, consumer: AIOKafkaConsumer, topic: str, delivery: Delivery, poll_timeout_ms: int,
        max_records: int | None = None, name: str = "", lost_partition_hold_seconds: float = 20.0,
    ) -> None:
        self.consumer = consumer
        self.topic = topic
        self.delivery = delivery
        self._poll_timeout_ms = poll_timeout_ms
        self._max_records = max_records
        self.ownership = PartitionOwnership(
            consumer, topic, delivery.acquire, delivery.release, name or topic, hold_seconds=lost_partition_hold_seconds,
        )
        self.cycles = 0
        delivery.bind(self)

    def subscribe(self) -> None:
        """Subscribe the consumer to the topic with the guard as its rebalance listener."""
        self.consumer.subscribe([self.topic], listener=self.ownership)

    def owned(self) -> list[TopicPartition]:
        return [TopicPartition(self.topic, p) for p in sorted(self.ownership.owned)]

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.poll_once()
        self.ownership.raise_error()
        async with self.ownership.lock:
            await self.delivery.process({}, final=True)
        await self.delivery.tick(final=True)

    async def poll_once(self) -> None:
        """One cycle (see the module docstring)."""
        self.ownership.raise_error()
        self.cycles += 1
        room = self.delivery.room()
        if room == 0:
            async with self.ownership.lock:
                self._flow(full=True)
            await self.delivery.wait_for_room(self._poll_timeout_ms / 1000)
            room = self.delivery.room()  # room made during the wait is used in this cycle
        async with self.ownership.lock:
            self._flow(full=room == 0)
        timeout_ms = 0 if room == 0 else self._poll_timeout_ms  # paused: the poll only keeps the membership
        limit = self._max_records if room is None else max(1, min(room, self._max_records or room))
        fetched = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=limit)
        snapshot = self.ownership.snapshot()  # no await since getmany returned
        async with self.ownership.lock:
            await self.ownership.retry_pending()
            pause = await self.delivery.process(self.ownership.accept(fetched, snapshot), final=False)
        await self.delivery.tick(final=False)
        if pause:
            await asyncio.sleep(pause)

    def _flow(self, full: bool) -> None:
        """Pause the owned partitions while full; resume them when not. Only owned ones are
        resumed: the guard keeps partitions it could not take paused."""
        owned = set(self.owned())
        paused = self.consumer.paused()
        if full and owned and not owned <= paused:
            self.consumer.pause(*owned)
        elif not full and (resume := sorted(owned & paused)):
            self.consumer.resume(*resume)

    async def positions(self) -> dict[int, int]:
        """The consumer's position of each owned partition (those it can tell now)."""
        found: dict[int, int] = {}
        for tp in self.owned():
            try:
                found[tp.partition] = await asyncio.wait_for(self.consumer.position(tp), POSITION_TIMEOUT_SECONDS)
            except (IllegalStateError, asyncio.TimeoutError, KafkaError):
                continue  # revoked meanwhile, or not known yet
        return found


class CommitRefused(RuntimeError):
    """Offsets could not be committed after every retry (another member may own them). For a
    trainer: the step's groups are read again by whoever owns their partitions next, and a
    restarted trainer resumes from its ledger."""


class Intake(Protocol):
    """A tier's side of an at-least-once loop: it takes records and says which are done."""

    async def acquire(self, partitions: set[int]) -> None: ...

    def release(self, partitions: set[int]) -> None:
        """Forget ``partitions`` (after what is done of them was committed)."""

    def room(self) -> int | None: ...

    async def wait_for_room(self, timeout: float) -> None: ...

    def take(self, records: Records) -> None:
        """Take the records (in offset order per partition); their output is the tier's."""

    def committable(self, positions: dict[int, int]) -> dict[int, int]:
        """The offset to commit per partition (everything below it done); ``positions``: the
        consumer's, for partitions whose records were all taken."""

    def committed(self, offsets: dict[int, int]) -> None:
        """``offsets`` were committed (nobody in the group reads below them again)."""

    async def tick(self) -> None:
        """Periodic work; raise what failed in the background."""


def _commit_retryable(error: BaseException) -> bool:
    # CommitFailedError: the group rebalanced under the commit; IllegalStateError: no
    # assignment while a rebalance is in progress. Both pass once we are a member again.
    return isinstance(error, (CommitFailedError, IllegalStateError)) or (
        isinstance(error, KafkaError) and bool(getattr(error, "retriable", False))
    )


class AtLeastOnce:
    """The at-least-once delivery: the intake's offsets committed by the consumer."""

    def __init__(self, intake: Intake, commit_interval: float | None, retry: RetryPolicy, name: str = "") -> None:
        self.intake = intake
        self._interval = commit_interval
        self._retry = retry
        self._name = name
        self._next_commit = time.monotonic() + (commit_interval or 0.0)
        self._committed: dict[int, int] = {}
        self.loop: PartitionLoop | None = None

    def bind(self, loop: PartitionLoop) -> None:
        self.loop = loop

    # -- the Delivery protocol --

    async def acquire(self, partitions: set[int]) -> set[int]:
        await self.intake.acquire(partitions)
        return set(partitions)

    async def release(self, partitions: set[int]) -> None:
        if self._interval is not None:  # what is done of them is committed before they move
            await self._commit_done(partitions, positions={})
        self.intake.release(partitions)
        for p in partitions:
            self._committed.pop(p, None)

    def room(self) -> int | None:
        return self.intake.room()

    async def wait_for_room(self, timeout: float) -> None:
        await self.intake.wait_for_room(timeout)

    async def process(self, records: Records, final: bool) -> float:
        self.intake.take(records)
        return 0.0

    async def tick(self, final: bool) -> None:
        await self.intake.tick()
        if self._interval is not None and (final or time.monotonic() >= self._next_commit):
            assert self.loop is not None
            await self._commit_done(set(self.loop.ownership.owned), await self.loop.positions())
            self._next_commit = time.monotonic() + self._interval

    # -- commits --

    async def commit(self, offsets: dict[int, int], what: str, metadata: str = "") -> dict[int, int]:
        """Commit ``offsets`` now (only those that moved; each with ``metadata``, which Kafka
        keeps with the offset), retried per the policy across rebalances;
        :class:`CommitRefused` when every try failed."""
        assert self.loop is not None, "bind() the delivery to its loop first"
        moved = {p: o for p, o in offsets.items() if o > self._committed.get(p, -1)}
        if not moved:
            return {}
        try:
            await self._retry.call(lambda: self._send(moved, metadata), retry_on=_commit_retryable, what=what)
        except (KafkaError, IllegalStateError) as exc:
            raise CommitRefused(f"{what}: offsets {moved} could not be committed ({exc})") from exc
        return moved

    async def _commit_done(self, partitions: set[int], positions: dict[int, int]) -> None:
        """Commit what the intake says is done of ``partitions`` (still assigned to the
        consumer); a failure is logged and tried again at the next commit point (committing
        late only means doing some work again)."""
        offsets = {p: o for p, o in self.intake.committable(positions).items()
                   if p in partitions and o != self._committed.get(p)}
        if not offsets:
            return
        try:
            await self._send(offsets)
        except (KafkaError, IllegalStateError) as exc:
            log.warning("%s: offset commit failed (%s: %s); will retry", self._name, type(exc).__name__, exc)
            return
        log.debug("%s: committed %s", self._name, offsets)

    async def _send(self, offsets: dict[int, int], metadata: str = "") -> None:
        """One commit of ``offsets``; once it succeeded, the intake hears of it."""
        assert self.loop is not None
        await self.loop.consumer.commit({TopicPartition(self.loop.topic, p): (o, metadata) for p, o in offsets.items()})
        self._committed.update(offsets)
        self.intake.committed(offsets)

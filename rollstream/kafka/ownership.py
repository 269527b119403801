"""The rebalance guard, written once: which input partitions this instance owns, and since when.

This instance is a partition's *partition owner* from taking it (rule 1) until losing it (rule
2): the consumer the group assigned it to, once it could act on it. A consumer's records are
processed only while their partition is owned in the same *ownership epoch* as when they were
fetched. The rules that make this skip nothing:

1. Taking a partition (assignment, or a rebuild after a failed transaction) runs the tier's
   ``acquire`` (e.g. registering the partition's transactional id, which fences every earlier
   partition owner, then restoring state), then SEEKS the partition to its committed offset,
   then bumps its epoch. Records fetched before that are dropped by aiokafka itself (their
   fetch position no longer matches) or by the epoch check here; either way they are read
   again from the committed offset. Nothing fetched is ever dropped without such a seek.
2. Losing a partition (revocation, or being fenced) bumps its epoch and runs ``release``;
   its new partition owner reads from the committed offset.
3. A partition the consumer holds but this instance cannot process (acquire failed, or it
   was fenced and the group has not told us yet) is PAUSED, so no record of it is fetched
   and dropped; acquisition is retried by :meth:`retry_pending`: at once after a failed
   acquire, and ``hold_seconds`` after being fenced (by then the group has normally
   reassigned it; if it still assigns it to us, taking it back is safe, since taking always
   fences and rebuilds from the committed state).

``lock`` serializes all of this with the tier's processing: the tier holds it from the
moment it looks at a fetch until that fetch's transactions are done, so a revocation waits
for the work in progress and a rebalance never interleaves with a transaction. It is never
held while waiting in ``getmany`` (aiokafka's fetch waits for a rebalance to finish, and the
rebalance waits for this lock).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.structs import ConsumerRecord, TopicPartition

log = logging.getLogger(__name__)

Fetched = dict[TopicPartition, list[ConsumerRecord]]
Hook = Callable[[set[int]], Awaitable[None]]
AcquireHook = Callable[[set[int]], Awaitable[set[int]]]  # returns the partitions it could take


class PartitionOwnership(ConsumerRebalanceListener):
    """Owned partitions of one topic with their epochs; the consumer's rebalance listener."""

    def __init__(self, consumer: AIOKafkaConsumer, topic: str, acquire: AcquireHook, release: Hook,
                 name: str = "", hold_seconds: float = 20.0) -> None:
        self._consumer = consumer
        self._topic = topic
        self._acquire = acquire
        self._release = release
        self._name = name or topic
        self._hold_seconds = hold_seconds
        self.lock = asyncio.Lock()
        self.owned: set[int] = set()
        self.pending: dict[int, float] = {}  # assigned, not acquired (paused): retry not before

        self._epochs: dict[int, int] = {}
        self.error: BaseException | None = None

    # -- the consumer's listener --

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        partitions = {tp.partition for tp in assigned if tp.topic == self._topic}
        async with self.lock:
            try:
                await self.take(partitions)
            except BaseException as exc:  # aiokafka logs and swallows listener errors
                self.error = exc
                raise
        log.info("%s: assigned partitions %s of %s", self._name, sorted(partitions) or "none", self._topic)

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        partitions = {tp.partition for tp in revoked if tp.topic == self._topic}
        async with self.lock:  # waits for the work in progress
            await self.drop(partitions)
        if partitions:
            log.info("%s: revoked partitions %s of %s", self._name, sorted(partitions), self._topic)

    # -- used by the tier (with ``lock`` held) --

    def snapshot(self) -> dict[int, int]:
        """The epochs of now; take it right after ``getmany`` returns (no await in between)."""
        return dict(self._epochs)

    def accept(self, fetched: Fetched, snapshot: dict[int, int]) -> dict[int, list[ConsumerRecord]]:
        """The fetched records still ours: partition owned, epoch unchanged since ``snapshot``.

        Records of a partition whose epoch moved were fetched before a seek to the committed
        offset (rule 1) or belong to a partition we lost (rule 2): both are read again.
        """
        accepted: dict[int, list[ConsumerRecord]] = {}
        for tp, records in fetched.items():
            p = tp.partition
            if not records or tp.topic != self._topic:
                continue
            if p in self.owned and self._epochs.get(p) == snapshot.get(p):
                accepted[p] = records
            # else: fetched before a seek that re-reads them (rule 1), of a partition we lost
            # (rule 2), or of one assigned but not yet taken: its take() seeks it (rule 1).
        return accepted

    async def take(self, partitions: Collection[int]) -> None:
        """Acquire ``partitions`` and seek them to their committed offsets (rule 1)."""
        wanted = set(partitions)
        if not wanted:
            return
        self._bump(wanted)
        self._consumer.pause(*self._held_tps(wanted))
        self.pending.update(dict.fromkeys(wanted, time.monotonic()))
        acquired = await self._acquire(wanted)
        await self._seek_to_committed(acquired)
        for p in acquired:
            self.pending.pop(p, None)
        self.owned |= acquired
        self._bump(acquired)
        self._consumer.resume(*self._held_tps(acquired))
        if wanted - acquired:
            log.warning("%s: could not take partitions %s yet; paused, will retry", self._name, sorted(wanted - acquired))

    async def drop(self, partitions: Collection[int]) -> None:
        """Forget ``partitions`` (rule 2): revoked, or taken over by another instance."""
        lost = set(partitions)
        if not lost:
            return
        self._bump(lost)
        self.owned -= lost
        for p in lost:
            self.pending.pop(p, None)
        await self._release(lost)

    async def lose(self, partitions: Collection[int]) -> None:
        """Fenced on ``partitions`` while the group still assigns them to us: drop and pause
        them (rule 3) until the group's next assignment says who owns them."""
        lost = set(partitions)
        await self.drop(lost)
        self._consumer.pause(*self._held_tps(lost))
        self.pending.update(dict.fromkeys(lost, time.monotonic() + self._hold_seconds))
        log.warning("%s: partitions %s are owned by another instance now; paused until the group rebalances",
                    self._name, sorted(lost))

    async def retake(self, partitions: Collection[int]) -> None:
        """Rebuild ``partitions`` from their committed state (after a failed transaction)."""
        parts = set(partitions) & self.owned
        await self.drop(parts)
        await self.take(parts)

    async def retry_pending(self) -> None:
        """Try again to take assigned partitions whose acquisition failed."""
        now = time.monotonic()
        self.pending = {p: at for p, at in self.pending.items() if self._held(p)}
        due = {p for p, at in self.pending.items() if at <= now}
        if due:
            await self.take(due)

    def raise_error(self) -> None:
        """Re-raise an error a rebalance callback hit (aiokafka swallows them)."""
        if self.error is not None:
            raise RuntimeError(f"{self._name}: taking partitions failed: {self.error!r}") from self.error

    # -- internals --

    def _tp(self, partition: int) -> TopicPartition:
        return TopicPartition(self._topic, partition)

    def _held(self, partition: int) -> bool:
        return self._tp(partition) in self._consumer.assignment()

    def _bump(self, partitions: Collection[int]) -> None:
        for p in partitions:
            self._epochs[p] = self._epochs.get(p, 0) + 1

    def _held_tps(self, partitions: Collection[int]) -> list[TopicPartition]:
        """``partitions`` (in order) that the consumer holds, as topic partitions."""
        return [self._tp(p) for p in partitions if self._held(p)]

    async def _seek_to_committed(self, partitions: Collection[int]) -> None:
        tps = self._held_tps(sorted(partitions))
        if not tps:
            return
        starts = await self._consumer.beginning_offsets(tps)
        targets = {tp: await self._consumer.committed(tp) for tp in tps}
        for tp in tps:  # no await from here on: the seeks and the new epochs go together
            offset = targets[tp]
            self._consumer.seek(tp, starts[tp] if offset is None else offset)

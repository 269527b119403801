"""Consume-transform-produce: the exactly-once delivery of the transactional tiers (reward
workers, grouping), run by the one :class:`~rollstream.kafka.partition_loop.PartitionLoop`.

:class:`ExactlyOnce` owns one transactional producer per owned input partition
(:class:`~rollstream.kafka.transactions.PartitionProducers`) and the retry policy; the loop
owns the consumer and the rebalance guard. A tier supplies a :class:`Transform`: what one
record becomes, what a partition emits at the end of a cycle, and how its state is rebuilt.
The transform never sees a transaction.

One cycle (under the guard's lock): the fetched records that are still ours are transformed;
anything a transform raises for a record makes that record a dead letter (with its origin and
the exception) and the tier goes on; then each owned partition's output (records, dead
letters, the input offset to commit) is committed in ONE transaction under that partition's
transactional id. Partitions commit independently:

- committed: ``Transform.committed`` runs (accounting, releases);
- fenced (another instance took the partition): the partition is dropped and paused until
  the group's next assignment;
- failed: the partition is rebuilt from its committed state (re-registered, restored,
  re-read) and the loop pauses per the retry policy; ``max_attempts`` failures in a row end
  the tier with :class:`~rollstream.retry.RetriesExhausted`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord, TopicPartition

from rollstream.runtime import metrics
from rollstream.kafka.dead_letter import dead_letter_for, send_dead_letter
from rollstream.kafka.ownership import PartitionOwnership
from rollstream.kafka.partition_loop import Delivery, PartitionLoop
from rollstream.kafka.record_size import size_problem
from rollstream.kafka.transactions import (
    FENCED_ERRORS,
    RETRYABLE_ERRORS,
    PartitionProducers,
    TransactionFailed,
    TransactionFenced,
)
from rollstream.retry import KAFKA_RETRY, RetryPolicy
from rollstream.wire import DeadLetter

log = logging.getLogger(__name__)


class RecordTooLargeError(ValueError):
    """An output record larger than the producer may send (``kafka.max_message_bytes``)."""


@dataclass
class OutRecord:
    topic: str
    value: bytes | None
    key: bytes | None
    partition: int | None = None


@dataclass
class PartitionOutput:
    """What one cycle sends for one input partition, committed in one transaction.

    ``consumed``: the offset after the last record transformed this cycle (None: none).
    ``offset``: the input offset to commit with it, set by :meth:`Transform.finish` (None:
    leave the committed offset where it is).
    """

    partition: int
    max_record_bytes: int
    records: list[OutRecord] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    consumed: int | None = None
    offset: int | None = None

    def send(self, topic: str, value: bytes | None, key: bytes | None, partition: int | None = None) -> None:
        """Queue a record; raises :class:`RecordTooLargeError` (nothing queued) when it cannot fit."""
        problem = size_problem(f"a {topic} record", value or b"", key, self.max_record_bytes)
        if problem is not None:
            raise RecordTooLargeError(problem)
        self.records.append(OutRecord(topic, value, key, partition))

    def empty(self) -> bool:
        return not self.records and not self.dead_letters and self.offset is None


class Transform(Protocol):
    """A tier's logic inside the loop. Called with the guard's lock held. A subclass inherits
    methods that do nothing for all but ``transform``."""

    tier: str
    concurrent: bool  # transform the records of a cycle concurrently (True) or one by one, in order

    async def acquire(self, partitions: set[int]) -> None:
        """Rebuild the state of newly owned ``partitions`` (their ids are registered already;
        the loop seeks them to their committed offsets afterwards)."""

    def release(self, partitions: set[int]) -> None:
        """Forget the state of ``partitions`` (revoked, fenced, or about to be rebuilt)."""

    async def begin(self, records: dict[int, list[ConsumerRecord]]) -> None:
        """Once per cycle, before its records are transformed."""

    async def transform(self, record: ConsumerRecord, out: PartitionOutput) -> None:
        """Turn one record into output (``out.send``). Raising dead-letters the record."""
        raise NotImplementedError

    def on_error(self, record: ConsumerRecord, error: Exception, out: PartitionOutput) -> None:
        """What else a dead-lettered record becomes (e.g. a failure its group must see)."""

    async def finish(self, partition: int, out: PartitionOutput, final: bool) -> None:
        """After the partition's records: emit what ended and set ``out.offset``.
        ``final``: the last cycle before shutdown."""

    async def committed(self, partition: int, out: PartitionOutput) -> None:
        """``out`` is committed (accounting; effects outside Kafka)."""


class RecordTransform(Transform):
    """A :class:`Transform` that keeps no state between records: a subclass writes
    :meth:`transform` (and ``on_error`` if a dead-lettered record must be answered downstream);
    each cycle commits the input offset after the partition's last record."""

    tier = ""
    concurrent = False

    async def finish(self, partition: int, out: PartitionOutput, final: bool) -> None:
        out.offset = out.consumed


class ExactlyOnce(Delivery):
    """The exactly-once delivery of a :class:`~rollstream.kafka.partition_loop.PartitionLoop`:
    each cycle transforms the records still owned and commits every owned partition's output
    with its input offset in one transaction under that partition's transactional id. It sets
    no room limit: the poll's max_records bounds a cycle."""

    def __init__(
        self,
        *,
        group_id: str,
        producers: PartitionProducers,
        transform: Transform,
        dead_letter_topic: str,
        max_record_bytes: int,
        retry: RetryPolicy | None = None,
        name: str = "",
    ) -> None:
        self._group_id = group_id
        self._producers = producers
        self._transform = transform
        self._dead_letter_topic = dead_letter_topic
        self._max_record_bytes = max_record_bytes
        self._backoff = (retry or KAFKA_RETRY.limited(max_attempts=10)).backoff()
        self._name = name or transform.tier
        self._topic = ""
        self._ownership: PartitionOwnership | None = None

    def bind(self, loop: PartitionLoop) -> None:
        self._topic = loop.topic
        self._ownership = loop.ownership

    async def process(self, records: dict[int, list[ConsumerRecord]], final: bool) -> float:
        """Transform ``records``, commit every owned partition's output; the pause to take
        before the next cycle (0 unless a transaction failed). Caller holds the lock."""
        ownership = self._ownership
        assert ownership is not None, "bind() the delivery to its loop first"
        outputs = {p: PartitionOutput(p, self._max_record_bytes) for p in sorted(ownership.owned)}
        records = {p: recs for p, recs in records.items() if p in outputs}
        await self._transform.begin(records)
        await self._transform_all(records, outputs)
        for p, out in outputs.items():
            await self._transform.finish(p, out, final)
        due = [out for out in outputs.values() if not out.empty()]
        results = await asyncio.gather(*(self._commit(out) for out in due))
        failed = [out.partition for out, error in zip(due, results) if error is not None]
        if not failed:
            self._backoff.succeeded()
            return 0.0
        pause = self._backoff.failed(next(e for e in results if e is not None))
        await ownership.retake(failed)
        return pause

    async def _transform_all(self, records: dict[int, list[ConsumerRecord]], outputs: dict[int, PartitionOutput]) -> None:
        flat = [(record, outputs[p]) for p, recs in records.items() for record in recs]
        for p, recs in records.items():
            outputs[p].consumed = recs[-1].offset + 1
            metrics.MESSAGES_IN.labels(self._transform.tier, self._topic).inc(len(recs))
        if not self._transform.concurrent:
            for record, out in flat:
                await self._guarded(record, out)
            return
        # each record writes into its own scratch output, merged in record order afterwards
        scratch = [PartitionOutput(out.partition, self._max_record_bytes) for _, out in flat]
        await asyncio.gather(*(self._guarded(record, tmp) for (record, _), tmp in zip(flat, scratch)))
        for (_, out), tmp in zip(flat, scratch):
            out.records += tmp.records
            out.dead_letters += tmp.dead_letters

    async def _guarded(self, record: ConsumerRecord, out: PartitionOutput) -> None:
        """The error policy: whatever the transform raises for ``record`` dead-letters it."""
        kept = len(out.records)
        try:
            await self._transform.transform(record, out)
        except Exception as exc:  # noqa: BLE001 - the policy is "any error of a record"
            del out.records[kept:]  # nothing half-done of this record is sent
            reason = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
            out.dead_letters.append(dead_letter_for(record, self._transform.tier, reason, exc))
            metrics.DEAD_LETTERS.labels(self._transform.tier, type(exc).__name__).inc()
            try:
                self._transform.on_error(record, exc, out)
            except Exception:  # noqa: BLE001 - the record is dead-lettered either way
                log.exception("%s: answering the dead-lettered record %s[%d]@%d failed",
                              self._name, record.topic, record.partition, record.offset)

    async def _commit(self, out: PartitionOutput) -> BaseException | None:
        """Commit one partition's output; None when committed, else the error (handled here)."""
        p = out.partition
        offsets = {TopicPartition(self._topic, p): out.offset} if out.offset is not None else None
        try:
            producer = self._producers.get(p)
            await producer.commit(lambda kp: self._write(kp, out), offsets, self._group_id)
        except TransactionFenced as exc:
            log.warning("%s: %s", self._name, exc)
            assert self._ownership is not None
            await self._ownership.lose({p})
            return None  # not a failure of ours: the partition has another partition owner
        except TransactionFailed as exc:
            return exc
        await self._transform.committed(p, out)
        for topic, n in Counter(r.topic for r in out.records).items():
            metrics.MESSAGES_OUT.labels(self._transform.tier, topic).inc(n)
        if out.dead_letters:
            metrics.MESSAGES_OUT.labels(self._transform.tier, self._dead_letter_topic).inc(len(out.dead_letters))
        return None

    async def _write(self, producer: AIOKafkaProducer, out: PartitionOutput) -> list[asyncio.Future[object]]:
        futures = [
            await producer.send(r.topic, r.value, key=r.key, partition=r.partition) for r in out.records
        ]
        for letter in out.dead_letters:
            await send_dead_letter(producer, self._dead_letter_topic, letter)
        return futures

    # -- taking and giving up partitions --

    async def acquire(self, partitions: set[int]) -> set[int]:
        """Register each partition's transactional id (fencing earlier partition owners), then let the
        transform rebuild their state. Returns the partitions taken; the others stay pending."""
        acquired: set[int] = set()
        for p in sorted(partitions):
            try:
                await self._producers.acquire(p)
            except FENCED_ERRORS:
                raise  # an authorization or protocol problem: no retry helps
            except RETRYABLE_ERRORS as exc:
                log.warning("%s: cannot register the producer of partition %d yet: %r", self._name, p, exc)
                continue
            acquired.add(p)
        if not acquired:
            return acquired
        started = time.monotonic()
        try:
            await self._transform.acquire(acquired)
        except RETRYABLE_ERRORS as exc:
            log.warning("%s: restoring partitions %s failed (%r); will retry", self._name, sorted(acquired), exc)
            for p in acquired:
                await self._producers.release(p)
            return set()
        log.debug("%s: took partitions %s in %.2fs", self._name, sorted(acquired), time.monotonic() - started)
        return acquired

    async def release(self, partitions: set[int]) -> None:
        self._transform.release(partitions)
        for p in partitions:
            await self._producers.release(p)


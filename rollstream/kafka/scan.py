"""Bounded reads: a topic's committed records between two offsets, once, written once.

Every reader that reads a topic to an end and stops (the budget rebuild, the cursor read, the
grouping changelog's restore, trainer replays, ``rollstream replay``) goes through
:func:`read_bounded`. It reads the partitions together with one group-less ``read_committed``
consumer, from ``start`` (default: the beginning) to an end fixed when the read starts:

- ``end`` given: those offsets;
- default: each partition's last stable offset as of now (committed records only; the read
  terminates even while producers keep writing);
- ``settled=True``: the high watermark, reached only once no transaction is pending on the
  partition (the grouping changelog: a predecessor's last commit markers may still be in
  flight, and its records must be seen).

:func:`high_watermarks` gives a fixed end that no open transaction hides: read to it, a
partition ends only once every transaction with records below it has committed or aborted
(the budget rebuild: every record committed before it took the end is seen, though producers
keep writing).

It yields one :class:`Chunk` per fetch: the records below the end, and the position reached
(which also moves over transaction markers and aborted records). Two deadlines, each raising
``TimeoutError`` naming what was not read: a partition that makes no progress for
``stall_seconds``, and a read not ended after ``timeout`` seconds (the tools: what a screen or
a check waits for).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from rollstream.config import KafkaConfig
from rollstream.kafka.admin import topic_partitions
from rollstream.kafka.clients import make_consumer, start_client, stop_client

FETCH_TIMEOUT_MS = 200
BOUNDED_FETCH_WAIT_MS = 50


@dataclass
class Chunk:
    """One fetch of a bounded read: ``records`` of ``partition``, all below the end, and the
    next offset the read will look at (``position``)."""

    partition: int
    position: int
    records: list[ConsumerRecord] = field(default_factory=list)


async def read_bounded(
    config: KafkaConfig,
    topic: str,
    client_id: str,
    *,
    partitions: Collection[int] | None = None,
    start: dict[int, int] | None = None,
    end: dict[int, int] | None = None,
    settled: bool = False,
    stall_seconds: float | None = None,
    timeout: float | None = None,
) -> AsyncIterator[Chunk]:
    """The committed records of ``topic`` (``partitions``, default all) between ``start`` and
    the end (see the module docstring), each partition in offset order."""
    deadline = None if timeout is None else time.monotonic() + timeout
    # A bounded read wants what is there, not to wait for more: the broker answers an empty
    # fetch at once rather than after fetch_max_wait_ms (a restore reads every partition).
    quick = msgspec.structs.replace(config, fetch_max_wait_ms=min(config.fetch_max_wait_ms, BOUNDED_FETCH_WAIT_MS))
    consumer = make_consumer(quick, client_id, group_id=None, read_committed=True)
    await start_client(consumer, config, f"a reader of {topic}")
    try:
        tps = await _partitions(config, topic, partitions)
        if not tps:
            return
        begins = await consumer.beginning_offsets(tps)
        stable = {} if settled else await consumer.end_offsets(tps)
        reads = {tp: _PartitionRead(tp, max((start or {}).get(tp.partition, 0), begins[tp]),
                                    (end or {}).get(tp.partition, stable.get(tp)), settled) for tp in tps}
        consumer.assign(tps)
        for tp, read in reads.items():
            consumer.seek(tp, read.position)
        while True:
            remaining = [tp for tp, read in reads.items() if not read.done(consumer)]
            if not remaining:
                return
            if deadline is not None and time.monotonic() > deadline:
                left = ", ".join(f"[{tp.partition}] at {reads[tp].position} of {reads[tp].limit(consumer)}" for tp in remaining)
                raise TimeoutError(f"reading {topic} to its end took over {timeout:.0f}s: {left}")
            fetched = await consumer.getmany(*remaining, timeout_ms=FETCH_TIMEOUT_MS)
            for tp in remaining:
                chunk = reads[tp].advance(fetched.get(tp, []), await consumer.position(tp), consumer, stall_seconds)
                if chunk is not None:
                    yield chunk
    finally:
        await stop_client(consumer, f"a reader of {topic}")


async def scan_topic(
    config: KafkaConfig, topic: str, client_id: str, end: dict[int, int] | None = None,
    stall_seconds: float | None = None, *, partitions: Collection[int] | None = None,
    start: dict[int, int] | None = None, timeout: float | None = None,
) -> AsyncIterator[ConsumerRecord]:
    """Every committed record of ``topic`` up to its current last stable offset, or to ``end``
    (:func:`read_bounded`'s read, record by record)."""
    chunks = read_bounded(config, topic, client_id, partitions=partitions, start=start, end=end,
                          stall_seconds=stall_seconds, timeout=timeout)
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            for record in chunk.records:
                yield record


async def high_watermarks(config: KafkaConfig, topic: str, client_id: str) -> dict[int, int]:
    """Each partition's high watermark now: the end of every record written so far, committed,
    aborted or in an open transaction (a ``read_uncommitted`` view of the end)."""
    return await _ends(config, topic, client_id, read_committed=False)


async def last_stable_offsets(config: KafkaConfig, topic: str, client_id: str) -> dict[int, int]:
    """Each partition's last stable offset now: the end of what a ``read_committed`` reader
    sees (no open transaction's records)."""
    return await _ends(config, topic, client_id, read_committed=True)


async def _ends(config: KafkaConfig, topic: str, client_id: str, *, read_committed: bool) -> dict[int, int]:
    consumer = make_consumer(config, client_id, group_id=None, read_committed=read_committed)
    await start_client(consumer, config, f"reading the end of {topic}")
    try:
        tps = await _partitions(config, topic, None)
        return {tp.partition: offset for tp, offset in (await consumer.end_offsets(tps)).items()} if tps else {}
    finally:
        await stop_client(consumer, f"the reader of the end of {topic}")


class _PartitionRead:
    """One partition's progress in a bounded read: its position and where it ends."""

    def __init__(self, tp: TopicPartition, first: int, end: int | None, settled: bool) -> None:
        self.tp = tp
        self.position = first
        self._end = end  # fixed offsets, or the stable end taken at the start
        self._settled = settled
        self._progressed = time.monotonic()

    def limit(self, consumer: AIOKafkaConsumer) -> int | None:
        """Where the read ends; None while a settled read has not seen the high watermark."""
        return consumer.highwater(self.tp) if self._settled and self._end is None else self._end

    def done(self, consumer: AIOKafkaConsumer) -> bool:
        limit = self.limit(consumer)
        return limit is not None and self.position >= limit

    def advance(
        self, fetched: list[ConsumerRecord], moved: int, consumer: AIOKafkaConsumer, stall_seconds: float | None,
    ) -> Chunk | None:
        """Take one fetch's records below the end; the chunk, or None when nothing moved."""
        limit = self.limit(consumer)
        records = [r for r in fetched if limit is None or r.offset < limit]
        if limit is not None:
            moved = min(moved, limit)
        if moved > self.position or records:
            self._progressed = time.monotonic()
        elif stall_seconds is not None and time.monotonic() - self._progressed > stall_seconds:
            raise TimeoutError(f"reading {self.tp.topic}[{self.tp.partition}] made no progress at offset "
                               f"{self.position} for {stall_seconds:.0f}s (end {limit})")
        before, self.position = self.position, max(self.position, moved)
        return Chunk(self.tp.partition, self.position, records) if records or self.position > before else None


async def _partitions(config: KafkaConfig, topic: str, wanted: Collection[int] | None) -> list[TopicPartition]:
    if wanted is not None:
        return [TopicPartition(topic, p) for p in sorted(set(wanted))]
    return [TopicPartition(topic, p) for p in await topic_partitions(config, topic) or []]

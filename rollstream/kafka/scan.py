"""Bounded reads: a topic's committed records between two offsets, once, written once.

Every reader that reads a topic to an end and stops (the budget rebuild, the cursor read, the
grouping changelog's restore, trainer replays, ``rollstream replay``) goes through
:func:`read_bounded`. It reads each partition in turn with a group-less ``read_committed``
consumer, from ``start`` (default: the beginning) to an end fixed when the read starts:

- ``end`` given: those offsets;
- default: each partition's last stable offset as of now (committed records only; the read
  terminates even while producers keep writing);
- ``settled=True``: the high watermark, reached only once no transaction is pending on the
  partition (the grouping changelog: a predecessor's last commit markers may still be in
  flight, and its records must be seen).

It yields one :class:`Chunk` per fetch: the records below the end, and the position reached
(which also moves over transaction markers and aborted records). A partition that makes no
progress for ``stall_seconds`` raises ``TimeoutError`` naming it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from rollstream.config import KafkaConfig
from rollstream.kafka.admin import topic_partitions
from rollstream.kafka.clients import make_consumer, start_client

FETCH_TIMEOUT_MS = 200


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
) -> AsyncIterator[Chunk]:
    """The committed records of ``topic`` (``partitions``, default all) between ``start`` and
    the end (see the module docstring), partition by partition in offset order."""
    consumer = make_consumer(config, client_id, group_id=None, read_committed=True)
    await start_client(consumer, config, f"a reader of {topic}")
    try:
        tps = await _partitions(config, topic, partitions)
        begins = await consumer.beginning_offsets(tps) if tps else {}
        ends = {} if settled else (await consumer.end_offsets(tps) if tps else {})
        for tp in tps:
            first = max((start or {}).get(tp.partition, 0), begins[tp])
            last = (end or {}).get(tp.partition)
            async for chunk in _read_partition(consumer, tp, first, last, ends.get(tp), settled, stall_seconds):
                yield chunk
    finally:
        await consumer.stop()


async def scan_topic(config: KafkaConfig, topic: str, client_id: str) -> AsyncIterator[ConsumerRecord]:
    """Every committed record of ``topic`` up to its current end."""
    chunks = read_bounded(config, topic, client_id)
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            for record in chunk.records:
                yield record


async def _read_partition(
    consumer: AIOKafkaConsumer, tp: TopicPartition, first: int, end: int | None, stable_end: int | None,
    settled: bool, stall_seconds: float | None,
) -> AsyncIterator[Chunk]:
    consumer.assign([tp])
    consumer.seek(tp, first)
    position, progressed = first, time.monotonic()
    while True:
        limit = end if end is not None else (consumer.highwater(tp) if settled else stable_end)
        if limit is not None and position >= limit:
            return
        fetched = (await consumer.getmany(tp, timeout_ms=FETCH_TIMEOUT_MS)).get(tp, [])
        limit = end if end is not None else (consumer.highwater(tp) if settled else stable_end)
        records = [r for r in fetched if limit is None or r.offset < limit]
        moved = await consumer.position(tp)
        if limit is not None:
            moved = min(moved, limit)
        if moved > position or records:
            progressed = time.monotonic()
        elif stall_seconds is not None and time.monotonic() - progressed > stall_seconds:
            raise TimeoutError(f"reading {tp.topic}[{tp.partition}] made no progress at offset {position} "
                               f"for {stall_seconds:.0f}s (end {limit})")
        position = max(position, moved)
        if records or moved:
            yield Chunk(tp.partition, position, records)


async def _partitions(config: KafkaConfig, topic: str, wanted: Collection[int] | None) -> list[TopicPartition]:
    if wanted is not None:
        return [TopicPartition(topic, p) for p in sorted(set(wanted))]
    return [TopicPartition(topic, p) for p in await topic_partitions(config, topic) or []]

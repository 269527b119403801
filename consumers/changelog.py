"""The grouping changelog: compacted, co-partitioned with ``scored`` (partition p <-> p).

Each ended group gets a ``GroupOutcome`` keyed by its task id, written to the changelog
partition of the group's source partition in the same transaction as the group's batch or
drop record. Outcomes older than the dedupe window get a tombstone (value None).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from rollstream.consumers.grouping import CompleteGroup, DroppedGroup
from rollstream.config import KafkaConfig
from rollstream.kafka.clients import make_consumer
from rollstream.wire import GroupOutcome, WireDecodeError, decode_outcome

log = logging.getLogger(__name__)

RESTORE_STALL_SECONDS = 30.0  # on top of the transaction timeout


def outcome_record(group: CompleteGroup | DroppedGroup) -> GroupOutcome:
    """The changelog value for an ended group."""
    return GroupOutcome(
        task_id=group.task_id,
        outcome="emitted" if isinstance(group, CompleteGroup) else "dropped",
        source_partition=group.partition,
        max_offset=group.max_offset,
        at=time.time(),
    )


async def read_outcomes(config: KafkaConfig, topic: str, partitions: Collection[int]) -> list[GroupOutcome]:
    """Every live outcome of ``partitions``: the changelog read from its beginning to its end.

    Uses a group-less ``read_committed`` consumer, so outcomes of aborted transactions are not
    seen. "The end" is the high watermark, reached only once no transaction is pending on
    the partition: a predecessor's last transaction may have committed with its markers still
    being written, and its outcomes must be seen before its input is re-read. Tombstones
    delete earlier outcomes; undecodable values are logged and skipped. Raises
    ``TimeoutError`` when nothing arrives for longer than a transaction can stay open.
    """
    if not partitions:
        return []
    stall_seconds = config.transaction_timeout_ms / 1000 + RESTORE_STALL_SECONDS
    consumer = make_consumer(config, "grouping-restore", group_id=None, read_committed=True)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        latest: dict[str, GroupOutcome | None] = {}
        stalled_at = time.monotonic() + stall_seconds
        while not await _caught_up(consumer, tps):
            fetched = await consumer.getmany(*tps, timeout_ms=200)
            for records in fetched.values():
                for record in records:
                    _apply(latest, record.key, record.value, record.offset)
                stalled_at = time.monotonic() + stall_seconds
            if time.monotonic() > stalled_at:
                raise asyncio.TimeoutError(f"restoring {topic} partitions {sorted(partitions)} stalled")
        return [outcome for outcome in latest.values() if outcome is not None]
    finally:
        await consumer.stop()


async def _caught_up(consumer: AIOKafkaConsumer, tps: list[TopicPartition]) -> bool:
    for tp in tps:
        highwater = consumer.highwater(tp)  # known after the first fetch response
        if highwater is None or await consumer.position(tp) < highwater:
            return False
    return True


def _apply(latest: dict[str, GroupOutcome | None], key: bytes | None, value: bytes | None, offset: int) -> None:
    if value is None:
        if key is not None:
            latest[key.decode("utf-8", "replace")] = None
        return
    try:
        outcome = decode_outcome(value)
    except WireDecodeError as exc:
        log.warning("skipping undecodable changelog record at offset %d: %s", offset, exc.reason)
        return
    latest[outcome.task_id] = outcome

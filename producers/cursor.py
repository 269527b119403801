"""The producer's dataset cursor, kept in the compacted ``producer_cursor`` topic.

A producer writes its cursor (the NEXT sample to publish) in the same transaction as the
prompts it covers, so the committed cursor always matches the committed prompts. Read it only
after the producer's transactional producer has started: starting it (``init_transactions``)
aborts any transaction a crashed predecessor with the same ``transactional_id`` left open,
which would otherwise hold the topic's last stable offset back.
"""

from __future__ import annotations

import asyncio
import logging
import time

from rollstream.config import RollstreamConfig
from rollstream.kafka.scan import scan_topic
from rollstream.kafka.topics import TopicNames
from rollstream.wire import ProducerCursor, WireDecodeError, decode_cursor, encode

log = logging.getLogger(__name__)

READ_TIMEOUT_SECONDS = 60.0


class CursorError(RuntimeError):
    """The cursor topic cannot be read, or its latest record for this producer is corrupt."""


def cursor_record(cursor: ProducerCursor) -> tuple[bytes, bytes]:
    """``(key, value)`` of the cursor record: keyed by producer id, so compaction keeps the last."""
    return cursor.producer_id.encode(), encode(cursor)


def advance(cursor: ProducerCursor, epoch: int, index: int, published: int) -> ProducerCursor:
    """A new cursor at ``(epoch, index)`` with ``published`` prompts so far."""
    return ProducerCursor(
        producer_id=cursor.producer_id, epoch=epoch, index=index, published=published, at=time.time(),
        is_eval=cursor.is_eval,
    )


async def read_cursor(
    config: RollstreamConfig, names: TopicNames, producer_id: str
) -> ProducerCursor | None:
    """The last committed cursor of ``producer_id``, or None when it has none (a fresh start).

    Reads the whole topic up to its last stable offset with a group-less ``read_committed``
    consumer. Raises ``CursorError`` when the topic cannot be read within 60 s (or
    ``kafka.outage_patience_seconds`` when longer: a broker outage is waited out) or when the
    latest record for this producer does not decode.
    """
    key = producer_id.encode()
    latest: tuple[int, int, bytes | None] | None = None  # partition, offset, value

    async def scan() -> None:
        nonlocal latest
        async for record in scan_topic(config.kafka, names.producer_cursor, f"cursor-reader-{producer_id}"):
            if record.key == key:
                latest = (record.partition, record.offset, record.value)

    timeout = max(READ_TIMEOUT_SECONDS, config.kafka.outage_patience_seconds)
    try:
        await asyncio.wait_for(scan(), timeout)
    except TimeoutError:
        raise CursorError(f"could not read {names.producer_cursor} to its end within {timeout:.0f}s") from None
    return _decode_latest(names.producer_cursor, producer_id, latest)


async def read_all_cursors(
    config: RollstreamConfig, names: TopicNames, end: dict[int, int] | None = None,
) -> dict[str, ProducerCursor]:
    """The last committed cursor of every producer of the trial (undecodable ones skipped),
    read to ``end`` (default: the last stable offset now; see ``rollstream.kafka.scan``)."""
    latest: dict[bytes, bytes | None] = {}
    stall = config.kafka.transaction_timeout_ms / 1000 + READ_TIMEOUT_SECONDS
    async for record in scan_topic(config.kafka, names.producer_cursor, "cursor-reader-all", end, stall):
        if record.key is not None:
            latest[record.key] = record.value
    cursors: dict[str, ProducerCursor] = {}
    for value in latest.values():
        if value is None:
            continue
        try:
            cursor = decode_cursor(value)
        except WireDecodeError as exc:
            log.warning("skipping an undecodable cursor record: %s", exc.reason)
            continue
        cursors[cursor.producer_id] = cursor
    return cursors


def _decode_latest(
    topic: str, producer_id: str, latest: tuple[int, int, bytes | None] | None
) -> ProducerCursor | None:
    if latest is None:
        return None
    partition, offset, value = latest
    if value is None:  # a tombstone: the cursor was deleted on purpose (start over)
        return None
    try:
        cursor = decode_cursor(value)
    except WireDecodeError as exc:
        # Falling back to an older cursor would republish prompts: refuse loudly instead.
        raise CursorError(
            f"cursor of producer {producer_id!r} at {topic}[{partition}]@{offset} is corrupt: {exc.reason}"
        ) from None
    if cursor.producer_id != producer_id:
        raise CursorError(
            f"cursor record at {topic}[{partition}]@{offset} keyed {producer_id!r} names "
            f"producer {cursor.producer_id!r}"
        )
    return cursor

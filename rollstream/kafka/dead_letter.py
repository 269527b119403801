"""Dead letters: a record a tier cannot process goes here with its origin and reason."""

from __future__ import annotations

import logging
import time

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from rollstream.wire import DeadLetter, encode

log = logging.getLogger(__name__)

MAX_DEAD_LETTER_VALUE = 4 * 1024 * 1024


def dead_letter_for(record: ConsumerRecord, tier: str, reason: str, error: BaseException | None = None) -> DeadLetter:
    """The dead letter describing ``record`` (its value cut to 4 MiB so the letter always fits)."""
    value = record.value
    if value is not None and len(value) > MAX_DEAD_LETTER_VALUE:
        value = value[:MAX_DEAD_LETTER_VALUE]
        reason = f"{reason} (value truncated to {MAX_DEAD_LETTER_VALUE} bytes)"
    return DeadLetter(
        tier=tier,
        source_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
        value=value,
        reason=reason,
        error_type=type(error).__name__ if error else "",
        at=time.time(),
    )


async def send_dead_letter(
    producer: AIOKafkaProducer, topic: str, letter: DeadLetter
) -> None:
    """Publish ``letter`` keyed like its source record; logs the reason at WARNING."""
    log.warning(
        "dead-lettered %s[%d]@%d: %s", letter.source_topic, letter.partition, letter.offset, letter.reason
    )
    await producer.send(topic, encode(letter), key=letter.key)

"""Dead letters: a record a tier cannot process goes here with its origin and reason."""

from __future__ import annotations

import logging
import time

import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.structs import ConsumerRecord

from rollstream.wire import DeadLetter, encode

log = logging.getLogger(__name__)

MAX_DEAD_LETTER_VALUE = 4 * 1024 * 1024
FALLBACK_VALUE_BYTES = 64 * 1024  # what is kept of a value too big for the producer
FALLBACK_KEY_BYTES = 1024


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
    """Publish ``letter`` keyed like its source record; logs the reason at WARNING.

    A consumer may receive a record bigger than its own producer may write (Kafka hands out a
    record larger than the fetch limit rather than getting stuck), so a letter that exceeds the
    producer's ``max_request_size`` is sent with its value cut to 64 KiB, or else without value
    (and its key cut to 1 KiB): one oversized record never stops a tier.
    """
    log.warning(
        "dead-lettered %s[%d]@%d: %s", letter.source_topic, letter.partition, letter.offset, letter.reason
    )
    try:
        await producer.send(topic, encode(letter), key=letter.key)
        return
    except MessageSizeTooLargeError:
        pass
    key = letter.key[:FALLBACK_KEY_BYTES] if letter.key is not None else None
    for value in (letter.value[:FALLBACK_VALUE_BYTES] if letter.value else None, None):
        kept = len(value) if value is not None else 0
        cut = msgspec.structs.replace(
            letter, key=key, value=value,
            reason=f"{letter.reason} (value cut to {kept} bytes: the letter exceeded max_request_size)",
        )
        try:
            await producer.send(topic, encode(cut), key=key)
            return
        except MessageSizeTooLargeError:
            if value is None:
                raise

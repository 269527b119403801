"""Whether a record fits the configured message size (``kafka.max_message_bytes``).

``rollstream topics create`` gives every topic ``max.message.bytes = kafka.max_message_bytes``
and every producer sends requests up to that size, so a record above it can never be written:
sending it would fail every retry. Tiers that write records of unbounded size (prompts with
images, episodes) check them first with :func:`size_problem` and turn a record that cannot fit
into a dead letter or a failed sample naming its size and the limit.
"""

from __future__ import annotations

RECORD_OVERHEAD_BYTES = 1024  # Kafka's per-record framing, with room to spare


def size_problem(what: str, value: bytes, key: bytes | None, limit: int) -> str | None:
    """Why a record of ``value`` and ``key`` cannot be written under ``limit`` bytes, or ``None``
    when it fits (the transactional tiers' :class:`PartitionOutput` checks with this too)."""
    size = len(value) + len(key or b"")
    if size + RECORD_OVERHEAD_BYTES <= limit:
        return None
    return (
        f"{what} of {size} bytes exceeds kafka.max_message_bytes={limit} (less {RECORD_OVERHEAD_BYTES} "
        "bytes of record framing)"
    )

"""The grouping changelog: compacted, co-partitioned with ``scored`` (partition p <-> p).

Each ended group gets a ``GroupOutcome`` keyed by its task id, written to the changelog
partition of the group's source partition in the same transaction as the group's emitted or
dropped record. Outcomes older than the dedupe window get a tombstone (value None).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection


from rollstream.consumers.grouping.groups import CompleteGroup, DroppedGroup
from rollstream.config import KafkaConfig
from rollstream.kafka.scan import read_bounded
from rollstream.wire import GroupOutcome, WireDecodeError, decode_outcome

log = logging.getLogger(__name__)

RESTORE_STALL_SECONDS = 30.0  # on top of the transaction timeout


def outcome_record(group: CompleteGroup | DroppedGroup, trainer_version: int) -> GroupOutcome:
    """The changelog value for an ended group whose record was tagged ``trainer_version``."""
    return GroupOutcome(
        task_id=group.task_id,
        outcome="emitted" if isinstance(group, CompleteGroup) else "dropped",
        source_partition=group.partition,
        max_offset=group.max_offset,
        at=time.time(),
        trainer_version=trainer_version,
    )


def version_floor(outcomes: list[GroupOutcome]) -> int:
    """The newest trainer version the outcomes' records were tagged with (-1: none known): the
    trainer reached it, so the instance that restores them never tags anything older."""
    return max((outcome.trainer_version for outcome in outcomes), default=-1)


async def read_outcomes(config: KafkaConfig, topic: str, partitions: Collection[int]) -> list[GroupOutcome]:
    """Every live outcome of ``partitions``: the changelog read from its beginning to its end.

    Committed records only (outcomes of aborted transactions are not seen), up to the high
    watermark reached once no transaction is pending (``settled``): a predecessor's last
    transaction may have committed with its markers still being written, and its outcomes must
    be seen before its input is re-read. Tombstones delete earlier outcomes; undecodable values
    are logged and skipped. Raises ``TimeoutError`` when nothing moves for longer than a
    transaction can stay open.
    """
    if not partitions:
        return []
    stall_seconds = config.transaction_timeout_ms / 1000 + RESTORE_STALL_SECONDS
    latest: dict[str, GroupOutcome | None] = {}
    chunks = read_bounded(config, topic, "grouping-restore", partitions=partitions, settled=True,
                          stall_seconds=stall_seconds)
    async for chunk in chunks:
        for record in chunk.records:
            _apply(latest, record.key, record.value, record.offset)
    return [outcome for outcome in latest.values() if outcome is not None]


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

"""What a grouping cycle writes for one input partition, and the slots it returns afterwards.

:class:`Emission` turns ended groups into records of the partition's transaction output
(:class:`~rollstream.kafka.consume_transform_produce.PartitionOutput`): the ``batch`` record
(an ``EmittedGroup``, tagged with the trainer version read at emission, never older than its
tokens: ``build_emitted_group``) or the ``dropped`` record on ``batches``, an ``outcome`` per
ended group and tombstones for forgotten outcomes on ``grouping-changelog`` (in the source
partition). A group that cannot become one record (its samples do not concatenate, a tensor is unusable, the record would exceed
``kafka.max_message_bytes``) is never retried forever: it becomes a dead letter naming the
error and a ``dropped`` record with reason ``dead_lettered``; the other groups are emitted.

:class:`SlotReleaser` returns the staleness slots of dropped train groups in Redis AFTER their
drop records are committed (a slot returned for a drop that then aborted could be re-decided
as emitted, which would over-admit). Redis being down never blocks emission: a failed release
is kept and retried next cycle (and lost if the process dies first: the slot stays taken, the
safe direction for the staleness bound).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from rollstream.consumers.grouping.records import build_emitted_group, drop_record
from rollstream.consumers.grouping.changelog import outcome_record
from rollstream.consumers.grouping.groups import CompleteGroup, DroppedGroup, drop_of
from rollstream.consumers.grouping.trainer_version import VersionReading
from rollstream.runtime import metrics
from rollstream.kafka.consume_transform_produce import PartitionOutput
from rollstream.kafka.topics import TopicNames
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import StateMissingError
from rollstream.wire import DeadLetter, encode

log = logging.getLogger(__name__)

TIER = "grouping"
RELEASE_TIMEOUT_SECONDS = 2.0
MAX_DETAIL_CHARS = 500


@dataclass(frozen=True)
class QueuedGroup:
    """A group queued as its ``EmittedGroup`` record, with the trainer version it is tagged with."""

    group: CompleteGroup
    trainer_version: int
    version_known: bool


class Emission:
    """Writes ended groups into a partition's output (pure: no I/O)."""

    def __init__(self, names: TopicNames, pad_value: float) -> None:
        self._names = names
        self._pad_value = pad_value

    def emit(
        self, groups: list[CompleteGroup], reading: VersionReading, out: PartitionOutput,
    ) -> tuple[list[QueuedGroup], list[DroppedGroup]]:
        """Queue each group's ``EmittedGroup`` record; returns the groups queued and those that
        could not become one record (already queued as dead letters and ``dead_lettered`` drops)."""
        emitted: list[QueuedGroup] = []
        refused: list[DroppedGroup] = []
        for group in groups:
            try:
                emitted.append(self._emit_one(group, reading, out))
            except Exception as exc:  # noqa: BLE001 - this group is at fault, the others are emitted
                refused.append(self._refuse(group, exc, reading.version, out))
        return emitted, refused

    def drop(self, drop: DroppedGroup, version: int, out: PartitionOutput) -> None:
        out.send(self._names.batches, encode(drop_record(drop, version)), key=drop.task_id.encode())
        self._outcome(drop, out, version)

    def tombstone(self, task_id: str, partition: int, out: PartitionOutput) -> None:
        out.send(self._names.grouping_changelog, None, key=task_id.encode(), partition=partition)

    def _emit_one(self, group: CompleteGroup, reading: VersionReading, out: PartitionOutput) -> QueuedGroup:
        record = build_emitted_group(group, reading.version, self._pad_value, version_known=reading.known)
        value = encode(record)  # may raise: nothing queued yet
        out.send(self._names.batches, value, key=group.task_id.encode())
        self._outcome(group, out, record.trainer_version)
        return QueuedGroup(group, record.trainer_version, record.trainer_version_known)

    def _outcome(self, group: CompleteGroup | DroppedGroup, out: PartitionOutput, trainer_version: int) -> None:
        value = encode(outcome_record(group, trainer_version))
        out.send(self._names.grouping_changelog, value, key=group.task_id.encode(), partition=group.partition)

    def _refuse(self, group: CompleteGroup, error: Exception, version: int, out: PartitionOutput) -> DroppedGroup:
        detail = f"group cannot be emitted: {type(error).__name__}: {error}"[:MAX_DETAIL_CHARS]
        out.dead_letters.append(DeadLetter(
            tier=TIER, source_topic=self._names.scored, partition=group.partition, offset=group.min_offset,
            key=group.task_id.encode(), value=None, reason=detail, error_type=type(error).__name__, at=time.time(),
        ))
        metrics.DEAD_LETTERS.labels(TIER, type(error).__name__).inc()
        drop = drop_of(group, "dead_lettered", detail)
        self.drop(drop, version, out)
        return drop


class SlotReleaser:
    """Returns the staleness slots of committed train drops; retries what Redis refused."""

    def __init__(self, budget: StalenessBudget) -> None:
        self._budget = budget
        self.unreleased: dict[str, str] = {}  # task -> reason, not yet taken back by Redis
        self._lock = asyncio.Lock()  # partitions commit concurrently: one release round at a time

    async def release(self, drops: list[DroppedGroup]) -> None:
        for drop in drops:
            if not drop.is_eval:
                self.unreleased[drop.task_id] = drop.reason
        async with self._lock:
            await self._release_unreleased()

    async def _release_unreleased(self) -> None:
        released = 0
        for task_id, reason in list(self.unreleased.items()):
            try:
                await asyncio.wait_for(self._budget.release(task_id, reason), RELEASE_TIMEOUT_SECONDS)
            except StateMissingError:
                log.warning("staleness state missing in Redis (restarted?); slot of %s kept until a producer rebuilds it", task_id)
                return
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                log.warning("cannot release the staleness slot of %s yet (%s); will retry", task_id, exc)
                return
            del self.unreleased[task_id]
            released += 1
        if released:
            try:
                await asyncio.wait_for(self._budget.notify(), RELEASE_TIMEOUT_SECONDS)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                log.warning("cannot notify producers of released slots: %s", exc)

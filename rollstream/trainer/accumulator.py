"""Turning ``batches`` records into steps of ``groups_per_step`` groups, with the offsets to commit.

Pure, no I/O: :class:`StepAccumulator` takes records one by one (a Kafka record, or a raw
value with its partition and offset) and hands out a :class:`Step` once ``groups_per_step`` groups
wait.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from aiokafka.structs import ConsumerRecord, TopicPartition

from rollstream.trainer.training_step import GroupRows, TrainingStep, assemble, emitted_group_rows
from rollstream.trajectory.staleness import staleness
from rollstream.wire import EmittedGroup, GroupDropped, WireDecodeError, decode_group

log = logging.getLogger(__name__)


@dataclass
class Step:
    """The groups of step ``number`` in the order they were read, and the offsets committing
    it commits (partition -> next offset, for every record taken up to them; empty for a replay);
    ``stale``: task ids of groups read since the step before and dropped as stale (never trained;
    their records commit with the step)."""

    number: int
    groups: list[GroupRows]
    offsets: dict[int, int]
    stale: list[str] = field(default_factory=list)


class RecentTasks:
    """The task ids of the last ``capacity`` groups handed out, oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: dict[str, None] = {}

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._ids

    def add(self, task_id: str) -> None:
        self._ids.pop(task_id, None)
        self._ids[task_id] = None
        while len(self._ids) > self.capacity:
            del self._ids[next(iter(self._ids))]


class StepAccumulator:
    """Collects groups record by record; hands out ``groups_per_step`` of them with commit offsets.

    The offsets of a step cover every record taken so far (one group per record), except the
    records of groups that wait for a later step: they are committed with that step.

    The consumption bound: :meth:`drop_stale`.

    Second line of defence against training on a group twice (the first is the pipeline's
    exactly-once emission): a group whose task id was handed out in the last
    ``remember_steps`` steps (e.g. re-delivered after a commit that a rebalance refused, or
    recorded in the trainer's ledger before a restart: :meth:`remember`) is skipped and
    counted in ``duplicates_skipped``, never silently.
    """

    def __init__(
        self, groups_per_step: int, pad_value: float = 0.0, include_eval: bool = False, remember_steps: int = 64,
        topic: str = "", image_processor: Any = None,
    ) -> None:
        self.groups_per_step = groups_per_step
        self.pad_value = pad_value
        self.include_eval = include_eval
        self.image_processor = image_processor  # rebuilds vision inputs in hand_out (None: bytes only)
        self.topic = topic
        self.drops_by_reason: Counter[str] = Counter()
        self.undecodable = 0
        self.eval_skipped = 0
        self.duplicates_skipped = 0
        self._stale: list[tuple[str, int]] = []  # (task id, partition) dropped as stale, in no step yet
        self.newest_tag = 0  # the newest trainer version a group read was tagged with
        self.trained = RecentTasks(max(1, remember_steps) * groups_per_step)
        self._groups: list[GroupRows] = []
        self._progress: dict[int, int] = {}  # next offset after the last record taken

    def ready(self) -> bool:
        return len(self._groups) >= self.groups_per_step

    @property
    def waiting(self) -> int:
        """Groups taken and not handed out yet."""
        return len(self._groups)

    def reset(self) -> None:
        """Forget what was taken but not handed out."""
        self._groups.clear()
        self._progress.clear()
        self._stale.clear()

    def drop_stale(self, consume_version: int, eta: int) -> list[str]:
        """Drop the waiting train groups whose oldest token is more than ``eta`` versions behind
        ``consume_version`` (the version of the weights the next step trains; a crash that
        re-emitted a group late, a long prefetch): counted in ``drops_by_reason["stale"]``, listed
        in the next step's ``stale``, never handed out. Eval groups are never dropped. Returns the
        task ids dropped now."""
        dropped = [g for g in self._groups
                   if not g.is_eval and staleness(consume_version, g.head_version) > eta]
        if not dropped:
            return []
        gone = {id(g) for g in dropped}
        self._groups = [g for g in self._groups if id(g) not in gone]
        for group in dropped:
            self.drops_by_reason["stale"] += 1
            self._stale.append((group.task_id, group.partition))
            log.warning("dropping group %s (head version %d) as stale: the next step trains version %d "
                        "(eta %d)", group.task_id, group.head_version, consume_version, eta)
        return [g.task_id for g in dropped]

    def forget(self, partitions: Collection[int]) -> None:
        """Forget what was taken from ``partitions`` and not handed out (they were revoked: their
        next owner, or we again, reads them from the committed offset)."""
        self._groups = [g for g in self._groups if g.partition not in partitions]
        for p in partitions:
            self._progress.pop(p, None)
        # a stale drop of a lost partition is read (and dropped) again by whoever owns it next
        self._stale = [(t, p) for t, p in self._stale if p not in partitions]

    def remember(self, task_ids: Iterable[str]) -> None:
        """Count ``task_ids`` as handed out already (groups a ledger says were trained)."""
        for task_id in task_ids:
            self.trained.add(task_id)

    def take(self, record: ConsumerRecord) -> None:
        """Take one ``batches`` record: groups queue up, drops and bad records are counted."""
        self.topic = self.topic or record.topic
        self.take_value(record.value, record.partition, record.offset)

    def take_value(self, value: bytes | None, partition: int, offset: int) -> None:
        """:meth:`take` for a record's value read from elsewhere (a replay)."""
        self._progress[partition] = offset + 1
        try:
            message = decode_group(value)
            groups = [emitted_group_rows(message)] if isinstance(message, EmittedGroup) else []
        except (WireDecodeError, ValueError) as exc:
            self.undecodable += 1
            log.warning("skipping undecodable batches record %d@%d: %s", partition, offset, exc)
            return
        if isinstance(message, GroupDropped):
            self.drops_by_reason[message.reason] += 1
            return
        if message.is_eval and not self.include_eval:
            self.eval_skipped += len(groups)
            return
        waiting = {g.task_id for g in self._groups}
        for group in groups:
            self.newest_tag = max(self.newest_tag, group.trainer_version)
            if group.task_id in self.trained or group.task_id in waiting:
                self.duplicates_skipped += 1
                log.warning("skipping group %s at %d@%d: already trained on (or waiting) in this run",
                            group.task_id, partition, offset)
                continue
            group.partition, group.offset = partition, offset
            self._groups.append(group)

    def next_step(self, number: int = 0) -> Step:
        """Step ``number``: the first ``groups_per_step`` waiting groups (call when :meth:`ready`)."""
        taken, self._groups = self._groups[: self.groups_per_step], self._groups[self.groups_per_step :]
        for group in taken:
            self.trained.add(group.task_id)
        offsets = dict(self._progress)
        for left in self._groups:  # waiting for a later step: its record is committed with it
            offsets[left.partition] = min(offsets.get(left.partition, left.offset), left.offset)
        stale, self._stale = [t for t, _ in self._stale], []
        return Step(number, taken, offsets, stale)

    def hand_out(self) -> TrainingStep:
        """:meth:`next_step` padded into one :class:`TrainingStep`."""
        groups = self.next_step()
        step = assemble(groups.groups, self.pad_value, self.image_processor)
        step.offsets = {TopicPartition(self.topic, p): o for p, o in groups.offsets.items()}
        return step

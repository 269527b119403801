"""Complete groups waiting to fill a batch of ``groups_per_batch`` (pure, no I/O).

A waiting group has ended in memory but is not yet in ``batches`` nor in the changelog, so it
must keep holding its partition's commit offset (:meth:`PendingBatches.low_offset`): after a
crash its records are re-read and the group is rebuilt. Train and eval groups queue apart and
never share a batch. A partial batch is flushed once its oldest group waited ``flush_seconds``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from consumers.grouping import CompleteGroup


@dataclass
class _Waiting:
    group: CompleteGroup
    since: float


class PendingBatches:
    """Two FIFO queues (train, eval) of complete groups; hands out full or overdue batches."""

    def __init__(self, groups_per_batch: int, flush_seconds: float) -> None:
        if groups_per_batch < 1:
            raise ValueError("grouping.groups_per_batch must be >= 1")
        self.groups_per_batch = groups_per_batch
        self.flush_seconds = flush_seconds
        self._queues: dict[bool, list[_Waiting]] = {False: [], True: []}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def add(self, group: CompleteGroup, now: float) -> None:
        self._queues[group.is_eval].append(_Waiting(group, now))

    def take_ready(self, now: float, flush_all: bool = False) -> list[list[CompleteGroup]]:
        """Full batches, plus a partial one per queue when overdue (or ``flush_all``)."""
        ready: list[list[CompleteGroup]] = []
        for is_eval, queue in self._queues.items():
            n = self.groups_per_batch
            while len(queue) >= n:
                ready.append([w.group for w in queue[:n]])
                del queue[:n]
            if queue and (flush_all or now - queue[0].since >= self.flush_seconds):
                ready.append([w.group for w in queue])
                queue.clear()
        return ready

    def low_offset(self, partition: int) -> int | None:
        """The lowest first offset of a waiting group of ``partition`` (None: none waiting)."""
        offsets = [
            w.group.min_offset for q in self._queues.values() for w in q if w.group.partition == partition
        ]
        return min(offsets) if offsets else None

    def revoke(self, partitions: Collection[int]) -> list[CompleteGroup]:
        """Remove and return the waiting groups of ``partitions`` (their new owner rebuilds them)."""
        wanted = set(partitions)
        removed: list[CompleteGroup] = []
        for queue in self._queues.values():
            removed += [w.group for w in queue if w.group.partition in wanted]
            queue[:] = [w for w in queue if w.group.partition not in wanted]
        return removed

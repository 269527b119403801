"""Complete groups waiting to fill a batch of ``groups_per_batch`` (pure, no I/O).

A waiting group has ended in memory but is not yet in ``batches`` nor in the changelog, so it
must keep holding its partition's commit offset (:meth:`PendingBatches.low_offset`): after a
crash its records are re-read and the group is rebuilt. Queues are per input partition (a
batch is committed in the transaction of ONE input partition, under that partition's
transactional id) and per kind: train and eval groups never share a batch. A partial batch is
flushed once its oldest group waited ``flush_seconds``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from rollstream.consumers.grouping import CompleteGroup


@dataclass
class _Waiting:
    group: CompleteGroup
    since: float


class PendingBatches:
    """FIFO queues of complete groups per (partition, is_eval); hands out full or overdue batches."""

    def __init__(self, groups_per_batch: int, flush_seconds: float) -> None:
        if groups_per_batch < 1:
            raise ValueError("grouping.groups_per_batch must be >= 1")
        self.groups_per_batch = groups_per_batch
        self.flush_seconds = flush_seconds
        self._queues: dict[tuple[int, bool], list[_Waiting]] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def add(self, group: CompleteGroup, now: float) -> None:
        self._queues.setdefault((group.partition, group.is_eval), []).append(_Waiting(group, now))

    def take_ready(self, partition: int, now: float, flush_all: bool = False) -> list[list[CompleteGroup]]:
        """``partition``'s full batches, plus a partial one per kind when overdue (or ``flush_all``)."""
        ready: list[list[CompleteGroup]] = []
        for is_eval in (False, True):
            queue = self._queues.get((partition, is_eval))
            if not queue:
                continue
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
        offsets = [w.group.min_offset for kind in (False, True) for w in self._queues.get((partition, kind), [])]
        return min(offsets) if offsets else None

    def revoke(self, partitions: Collection[int]) -> list[CompleteGroup]:
        """Remove and return the waiting groups of ``partitions`` (their new owner rebuilds them)."""
        removed: list[CompleteGroup] = []
        for key in [k for k in self._queues if k[0] in set(partitions)]:
            removed += [w.group for w in self._queues.pop(key)]
        return removed

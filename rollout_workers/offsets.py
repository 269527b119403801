"""Which prompt offsets may be committed: contiguous completion per partition.

A rollout worker takes prompt records in offset order but finishes them in any order. An
offset may be committed only when every prompt taken before it on the same partition has
published all of its samples, so a crash re-runs exactly the unfinished prompts (and
possibly a few finished ones after them; duplicates are removed downstream).

Callers may rely on:

* ``committable()`` never names an offset beyond a prompt that is not done;
* offsets that were never ``add``-ed (gaps left by transaction markers, aborted or compacted
  records) never block anything;
* ``done`` and ``forget`` are idempotent, and ``done`` of an unknown partition or offset (a
  prompt whose partition was revoked while it ran) is ignored.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka.structs import TopicPartition


@dataclass
class _PartitionState:
    pending: set[int] = field(default_factory=set)  # taken, not all samples published yet
    heap: list[int] = field(default_factory=list)  # pending offsets, lazily pruned of done ones
    next_offset: int = 0  # one past the highest offset taken (or the consumer's position)

    def lowest_pending(self) -> int | None:
        while self.heap and self.heap[0] not in self.pending:
            heapq.heappop(self.heap)
        return self.heap[0] if self.heap else None


class OffsetTracker:
    """Per-partition bookkeeping of taken and finished prompt records."""

    def __init__(self) -> None:
        self._partitions: dict[TopicPartition, _PartitionState] = {}

    def add(self, tp: TopicPartition, offset: int) -> None:
        """Record that the prompt at ``offset`` was taken and is now in flight."""
        state = self._partitions.setdefault(tp, _PartitionState(next_offset=offset))
        if offset in state.pending:
            return
        state.pending.add(offset)
        heapq.heappush(state.heap, offset)
        state.next_offset = max(state.next_offset, offset + 1)

    def done(self, tp: TopicPartition, offset: int) -> None:
        """Record that every sample of the prompt at ``offset`` is published."""
        state = self._partitions.get(tp)
        if state is not None:
            state.pending.discard(offset)

    def advance(self, tp: TopicPartition, position: int) -> None:
        """Let the commit point move up to the consumer's ``position`` once nothing is pending.

        The position can be past the last record taken (a transaction's commit marker);
        committing it keeps the group's lag at zero. Call it only with a position whose
        records have all been ``add``-ed.
        """
        state = self._partitions.setdefault(tp, _PartitionState(next_offset=position))
        state.next_offset = max(state.next_offset, position)

    def committable(self) -> dict[TopicPartition, int]:
        """For each known partition, the offset to commit: the lowest one not yet done."""
        result: dict[TopicPartition, int] = {}
        for tp, state in self._partitions.items():
            lowest = state.lowest_pending()
            result[tp] = state.next_offset if lowest is None else lowest
        return result

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """Drop all state of ``tps`` (revoked partitions); later ``done`` calls are ignored."""
        for tp in tps:
            self._partitions.pop(tp, None)

    def in_flight(self, tp: TopicPartition | None = None) -> int:
        """How many taken prompts are not done (on ``tp``, or on every partition)."""
        if tp is not None:
            state = self._partitions.get(tp)
            return len(state.pending) if state else 0
        return sum(len(state.pending) for state in self._partitions.values())

"""Where a trainer's steps come from: the contract every source of steps keeps.

A :class:`StepSource` hands out :class:`Step` objects (the groups of one step, numbered from
the last committed step + 1) and commits steps. The live source reads ``batches`` in the
trainer's consumer group (:mod:`rollstream.trainer.kafka_source`); a replay reads a recorded
range or a dump and commits nothing (:mod:`rollstream.trainer.replay`). The single-process
and the multi-rank streams run on either, so a replayed step reaches the same trainer code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rollstream.trainer.accumulator import StepAccumulator
from rollstream.trainer.ledger import LedgerEntry
from rollstream.trainer.training_step import GroupRows


@dataclass
class Step:
    """The groups of step ``number`` in the order they were read, and the offsets committing
    it commits (partition -> next offset; empty for a replay); ``stale``: task ids of groups
    read for it and dropped as stale (never trained; their records commit with the step)."""

    number: int
    groups: list[GroupRows]
    offsets: dict[int, int]
    stale: list[str] = field(default_factory=list)


class StepSource(Protocol):
    """A source of steps; used from one event loop."""

    topic: str  # the ``batches`` topic the steps come from
    accumulator: StepAccumulator  # its counters: drops, undecodable, eval skipped, duplicates

    async def start(self) -> int:
        """Get ready; returns the last step committed before (0: none)."""

    async def next_step(self, timeout: float | None) -> Step | None:
        """The next step, or None when ``timeout`` seconds passed first (or the source is
        exhausted: see ``exhausted``)."""

    @property
    def exhausted(self) -> bool:
        """True when no step will ever come again (a replay at its end)."""

    async def commit(self, entries: list[LedgerEntry]) -> None:
        """Make ``entries`` (finished steps, oldest first) durable; raises when it cannot."""

    async def close(self) -> None:
        """Release everything; steps handed out and not committed are read again next time."""

"""Where a trainer's steps come from: the contract every source of steps keeps.

A :class:`StepSource` hands out :class:`Step` objects (the groups of one step, numbered from
the last committed step + 1) and commits steps. The live source reads ``batches`` in the
trainer's consumer group (:mod:`rollstream.trainer.kafka_source`); a replay reads a recorded
range or a dump and commits nothing (:mod:`rollstream.trainer.replay`). The single-process
and the multi-rank streams run on either, so a replayed step reaches the same trainer code.
"""

from __future__ import annotations

from typing import Protocol

from rollstream.trainer.accumulator import Step, StepAccumulator
from rollstream.trainer.ledger import LedgerEntry


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

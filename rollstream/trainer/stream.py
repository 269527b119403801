"""The asyncio trainer API, for a single-process trainer whose loop is a coroutine.

    async with BatchStream(config) as batches:
        async for batch in batches:                       # staleness.groups_per_step groups
            await asyncio.to_thread(train_step, batch)    # keep the event loop free
            await batches.commit(batch)                   # now the step is never delivered again

The step itself must not block the event loop for long (run it in a thread, as above): the
stream polls Kafka on the same loop. A synchronous loop, or ``torchrun``, uses
:class:`rollstream.trainer.TrainerBatches` instead, which runs this machinery on a thread.

Delivery: a step's records are committed only by :meth:`BatchStream.commit`, so a trainer
that dies before it gets the same groups again; commits are cumulative (committing a step
commits every step handed out before it). Dropped groups are counted in ``drops_by_reason``, undecodable records in ``undecodable``
(skipped with a warning, never raised), a group already handed out in a recent step in
``duplicates_skipped``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any

import msgspec
from aiokafka.structs import TopicPartition

from rollstream.config import RollstreamConfig
from rollstream.trainer.batch import StepAssembler, TrainingBatch, trainer_image_processor
from rollstream.trainer.kafka_source import CommitRefused, KafkaStepSource
from rollstream.trainer.ledger import LedgerEntry
from rollstream.trainer.steps import Step, StepSource

log = logging.getLogger(__name__)


class StepBook:
    """Steps handed out and not committed yet, and the ledger entries that commit them."""

    def __init__(self) -> None:
        self.pending: dict[int, LedgerEntry] = {}
        self.last_committed = 0

    def handed_out(self, step: Step, shares: list[list[str]]) -> None:
        """Step ``step`` went out, ``shares[r]`` being rank r's task ids."""
        self.pending[step.number] = LedgerEntry(
            step.number, dict(step.offsets), [g.task_id for g in step.groups],
            [[g.partition, g.offset] for g in step.groups], shares, stale=list(step.stale),
        )

    def due(self, step: int) -> list[LedgerEntry]:
        """The entries committing ``step`` commits (every pending step up to it), oldest first."""
        if step <= self.last_committed:
            return []
        if step not in self.pending:
            raise ValueError(f"step {step} was not handed out by this stream")
        return [self.pending[n] for n in sorted(self.pending) if n <= step]

    def committed(self, step: int) -> None:
        for n in [n for n in self.pending if n <= step]:
            del self.pending[n]
        self.last_committed = max(self.last_committed, step)


class BatchStream:
    """Async iterator of :class:`TrainingBatch`, one per step (see the module docstring).

    ``include_eval=False`` skips eval groups (counted in ``eval_skipped``); with True they are
    delivered and flagged per group in ``TrainingBatch.group_is_eval``. ``source`` replaces
    the live Kafka source (e.g. a :class:`~rollstream.trainer.replay.ReplaySource`);
    ``ledger=False`` keeps no ledger (nothing but Kafka's offsets survives a restart).
    Batches with images get ``TrainingBatch.vision`` rebuilt by ``image_processor`` (default:
    the one of ``trainer.processor_path``, when set).
    """

    def __init__(
        self,
        config: RollstreamConfig,
        *,
        include_eval: bool = False,
        client_id: str = "trainer",
        poll_timeout_ms: int | None = None,
        source: StepSource | None = None,
        ledger: bool = True,
        image_processor: Any = None,
        published: Callable[[], int] | None = None,
    ) -> None:
        if poll_timeout_ms is not None:
            trainer = msgspec.structs.replace(config.trainer, poll_timeout_ms=poll_timeout_ms)
            config = msgspec.structs.replace(config, trainer=trainer)
        self.config = config
        self.batch_size = config.staleness.groups_per_step
        self.source: StepSource = source or KafkaStepSource(
            config, include_eval=include_eval, client_id=client_id, use_ledger=ledger, published=published
        )
        self.book = StepBook()
        self._pad_value = config.grouping.pad_value
        self._images = StepAssembler(image_processor if image_processor is not None else trainer_image_processor(config))

    # -- counters --

    @property
    def drops_by_reason(self) -> Counter[str]:
        return self.source.accumulator.drops_by_reason

    @property
    def undecodable(self) -> int:
        return self.source.accumulator.undecodable

    @property
    def eval_skipped(self) -> int:
        return self.source.accumulator.eval_skipped

    @property
    def duplicates_skipped(self) -> int:
        """Groups skipped because they were handed out before (see BatchAccumulator)."""
        return self.source.accumulator.duplicates_skipped

    @property
    def last_committed_step(self) -> int:
        """The last step committed, by this stream or before a restart (0: none)."""
        return self.book.last_committed

    # -- lifecycle --

    async def start(self) -> None:
        self.book.last_committed = await self.source.start()

    async def close(self) -> None:
        await self.source.close()

    async def __aenter__(self) -> BatchStream:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    def __aiter__(self) -> BatchStream:
        return self

    async def __anext__(self) -> TrainingBatch:
        while True:
            batch = await self.next_batch(timeout=None if not self.source.exhausted else 0)
            if batch is not None:
                return batch
            if self.source.exhausted:
                raise StopAsyncIteration

    # -- steps --

    async def next_batch(self, timeout: float | None = None) -> TrainingBatch | None:
        """The next step's groups, or None if they did not arrive within ``timeout`` s."""
        step = await self.source.next_step(timeout)
        if step is None:
            return None
        self.book.handed_out(step, [[g.task_id for g in step.groups]])
        batch = self._images.assemble(step.groups, self._pad_value)
        batch.step = step.number
        batch.offsets = {TopicPartition(self.source.topic, p): o for p, o in step.offsets.items()}
        return batch

    async def commit(self, batch: TrainingBatch) -> None:
        """Commit ``batch``'s step (and every step handed out before it); raises
        :class:`CommitRefused` when the group would not take the commit after every retry."""
        entries = self.book.due(batch.step)
        if not entries:
            return
        await self.source.commit(entries)
        self.book.committed(batch.step)

    async def ack(self, batch: TrainingBatch) -> bool:
        """:meth:`commit`, answering False instead of raising when the commit was refused."""
        try:
            await self.commit(batch)
        except CommitRefused as exc:
            log.warning("ack failed (%s); the batch's groups will be re-delivered", exc)
            return False
        return True


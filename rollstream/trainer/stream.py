"""The asyncio trainer API, for a single-process trainer whose loop is a coroutine.

    async with StepStream(config) as steps:
        async for step in steps:                          # staleness.groups_per_step groups
            await asyncio.to_thread(train_step, step)     # keep the event loop free
            await steps.commit(step)                      # now the step is never delivered again

The step itself must not block the event loop for long (run it in a thread, as above): the
stream polls Kafka on the same loop. A synchronous loop, or ``torchrun``, uses
:class:`rollstream.trainer.TrainerSteps` instead, which runs this machinery on a thread.

Delivery: a step's records are committed only by :meth:`StepStream.commit`, so a trainer
that dies before it gets the same groups again; commits are cumulative (committing a step
commits every step handed out before it). Dropped groups are counted in ``drops_by_reason``, undecodable records in ``undecodable``
(skipped with a warning, never raised), a group already handed out in a recent step in
``duplicates_skipped``.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
from aiokafka.structs import TopicPartition

from rollstream.config import RollstreamConfig
from rollstream.trainer.kafka_source import CommitRefused, KafkaStepSource
from rollstream.trainer.ledger import LedgerEntry
from rollstream.trainer.step_source import Step, StepSource
from rollstream.trainer.training_step import GroupRows, TrainingStep, assemble, trainer_image_processor

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
        self.pending = {n: entry for n, entry in self.pending.items() if n > step}
        self.last_committed = max(self.last_committed, step)


class StepFrontEnd:
    """What :class:`StepStream` and :class:`~rollstream.trainer.TrainerSteps` share: the steps
    handed out (``book``), their groups padded into a :class:`TrainingStep`, the counters of
    the step source (``source``; zero where there is none, on ranks other than 0), and how to
    make the live Kafka source when no other is given (``live_source``)."""

    source: StepSource | None

    def __init__(
        self, config: RollstreamConfig, image_processor: Any, *, include_eval: bool, client_id: str, ledger: bool,
        published: Callable[[], int] | None,
    ) -> None:
        self.config = config
        self.live_source: Callable[[], KafkaStepSource] = functools.partial(
            KafkaStepSource, config, include_eval=include_eval, client_id=client_id, use_ledger=ledger,
            published=published,
        )
        self.book = StepBook()
        self._pad_value = config.grouping.pad_value
        self._image_processor = image_processor if image_processor is not None else trainer_image_processor(config)
        self._warned = False  # of steps with images and no image processor to rebuild them

    def _assemble(self, groups: list[GroupRows], number: int, offsets: dict[int, int]) -> TrainingStep:
        """Step ``number``'s ``groups``, with the ``offsets`` (partition: offset) it commits."""
        step = assemble(groups, self._pad_value, self._image_processor)
        if step.group_images and self._image_processor is None and not self._warned:
            self._warned = True
            log.warning("groups carry images but no image processor is set (trainer.processor_path): "
                        "TrainingStep.vision is None; rebuild it with rollstream.vision.inputs.build_vision_inputs")
        step.step = number
        topic = self.source.topic if self.source is not None else ""
        step.offsets = {TopicPartition(topic, p): o for p, o in offsets.items()}
        return step

    def _counter(self, name: str) -> Any:
        return getattr(self.source.accumulator, name) if self.source is not None else 0

    @property
    def drops_by_reason(self) -> Counter[str]:
        return self.source.accumulator.drops_by_reason if self.source is not None else Counter()

    @property
    def undecodable(self) -> int:
        return self._counter("undecodable")

    @property
    def eval_skipped(self) -> int:
        return self._counter("eval_skipped")

    @property
    def duplicates_skipped(self) -> int:
        """Groups skipped because they were handed out before (see StepAccumulator)."""
        return self._counter("duplicates_skipped")

    @property
    def last_committed_step(self) -> int:
        """The last step committed, by this process or before a restart (0: none); every rank."""
        return self.book.last_committed


class StepStream(StepFrontEnd):
    """Async iterator of :class:`TrainingStep`, one per step (see the module docstring).

    ``include_eval=False`` skips eval groups (counted in ``eval_skipped``); with True they are
    delivered and flagged per group in ``TrainingStep.group_is_eval``. ``source`` replaces
    the live Kafka source (e.g. a replay: :mod:`rollstream.trainer.replay`);
    ``ledger=False`` keeps no ledger (nothing but Kafka's offsets survives a restart).
    Steps with images get ``TrainingStep.vision`` rebuilt by ``image_processor`` (default:
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
        super().__init__(config, image_processor, include_eval=include_eval, client_id=client_id, ledger=ledger,
                         published=published)
        self.source: StepSource = source or self.live_source()

    # -- lifecycle --

    async def start(self) -> None:
        self.book.last_committed = await self.source.start()

    async def close(self) -> None:
        await self.source.close()

    async def __aenter__(self) -> StepStream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __aiter__(self) -> StepStream:
        return self

    async def __anext__(self) -> TrainingStep:
        while True:
            step = await self.next_step(timeout=None if not self.source.exhausted else 0)
            if step is not None:
                return step
            if self.source.exhausted:
                raise StopAsyncIteration

    # -- steps --

    async def next_step(self, timeout: float | None = None) -> TrainingStep | None:
        """The next step's groups, or None if they did not arrive within ``timeout`` s."""
        groups = await self.source.next_step(timeout)
        if groups is None:
            return None
        self.book.handed_out(groups, [[g.task_id for g in groups.groups]])
        return self._assemble(groups.groups, groups.number, groups.offsets)

    async def commit(self, step: TrainingStep) -> None:
        """Commit ``step`` (and every step handed out before it); raises
        :class:`CommitRefused` when the group would not take the commit after every retry."""
        entries = self.book.due(step.step)
        if not entries:
            return
        await self.source.commit(entries)
        self.book.committed(step.step)

    async def ack(self, step: TrainingStep) -> bool:
        """:meth:`commit`, answering False instead of raising when the commit was refused."""
        try:
            await self.commit(step)
        except CommitRefused as exc:
            log.warning("ack failed (%s); the step's groups will be re-delivered", exc)
            return False
        return True


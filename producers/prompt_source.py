"""The producer's run: dataset rows -> admitted prompts on ``prompts``, with the cursor.

For each sample from the committed cursor on, :class:`PromptSource` derives a deterministic
task id ``"{producer_id}:{epoch}:{index}"``, admits it through the staleness budget (eval
prompts skip admission), and publishes the ``PromptTask`` plus the advanced cursor in one
Kafka transaction (several prompts per transaction). A row that cannot become a prompt record
is dead-lettered with the reason and skipped, the cursor moving past it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rollstream.config import RollstreamConfig
from rollstream.kafka.consume_transform_produce import RecordTooLargeError
from rollstream.kafka.clients import start_client
from rollstream.kafka.record_size import size_problem
from rollstream.kafka.topics import TopicNames
from rollstream.kafka.transactions import TransactionalProducer
from rollstream.producers.admission import Admission, BudgetRebuilt
from rollstream.producers.cursor import advance, read_cursor
from rollstream.producers.dataset import iter_samples, next_position, task_id_for
from rollstream.producers.prompt_images import image_sizes, with_encoded_images
from rollstream.producers.publisher import TIER, PendingBatch, PromptPublisher
from rollstream.tier.context import StopBeforeReady, before_stop
from rollstream.wire import DeadLetter, ProducerCursor, PromptTask, encode

log = logging.getLogger(__name__)


@dataclass
class RunSummary:
    """What one run of the producer did; ``reason`` is exhausted | max_prompts | stopped."""

    published: int = 0  # prompts committed by this run
    eval_prompts: int = 0
    dead_lettered: int = 0  # dataset rows that could not be encoded
    transactions: int = 0
    admission_waits: int = 0
    total_published: int = 0  # including earlier runs (from the cursor)
    restarts: int = 0  # starts from the committed cursor after a budget rebuild
    reason: str = "stopped"


class PromptSource:
    """The producer's run: publish from the committed cursor on, starting again from it after a
    budget rebuild, until the dataset or ``producer.max_prompts`` is exhausted or ``stop``."""

    def __init__(self, config: RollstreamConfig, names: TopicNames, rows: list[dict[str, Any]],
                 txn: TransactionalProducer, admission: Admission, publisher: PromptPublisher) -> None:
        self._config, self._names, self._rows = config, names, rows
        self._txn, self._admission, self._publisher = txn, admission, publisher

    async def run(self, stop: asyncio.Event) -> RunSummary:
        config, pc, summary = self._config, self._config.producer, RunSummary()
        while True:
            try:  # the start may wait minutes (the broker, Redis, a budget rebuild): a stop cuts it short
                cursor = await before_stop(_start(config, self._names, self._txn, self._admission, self._publisher),
                                           stop, lambda: f"starting producer {pc.producer_id}")
            except StopBeforeReady as exc:
                log.info("%s", exc)
                break
            summary.total_published = cursor.published
            try:
                await _ProduceLoop(config, self._rows, cursor, self._admission, self._publisher, stop, summary).run()
                break
            except BudgetRebuilt as exc:
                summary.restarts += 1
                log.warning("producer %s starts again from its committed cursor: %s", pc.producer_id, exc)
                await self._txn.stop()  # fenced by the rebuild: a new producer registers the id again
        log.info(
            "producer %s finished (%s): %d prompts published (%d eval, %d total), %d rows dead-lettered, "
            "%d transactions, %d admission waits, %d restarts after a budget rebuild",
            pc.producer_id, summary.reason, summary.published, summary.eval_prompts, summary.total_published,
            summary.dead_lettered, summary.transactions, summary.admission_waits, summary.restarts,
        )
        return summary


async def _start(
    config: RollstreamConfig, names: TopicNames, txn: TransactionalProducer, admission: Admission,
    publisher: PromptPublisher,
) -> ProducerCursor:
    """(Re)start: the budget's generation, then the transactional producer, then the cursor.

    Starting the producer fences a crashed predecessor and aborts its open transaction, so the
    cursor read sees the final committed state. A producer without a cursor commits one before
    its first admission, so a budget rebuild knows (and fences) every producer that admits.
    """
    pc = config.producer
    await admission.begin()  # before the producer starts: see producers/admission.py
    await start_client(txn, config.kafka, f"the transactional producer of producer {pc.producer_id}")
    cursor = await read_cursor(config, names, pc.producer_id)
    if cursor is None:
        cursor = ProducerCursor(producer_id=pc.producer_id, epoch=0, index=0, published=0, is_eval=pc.is_eval)
        await publisher.commit(PendingBatch(cursor=cursor))
    cursor = msgspec.structs.replace(cursor, is_eval=pc.is_eval)
    log.info(
        "producer %s starts at epoch %d index %d (%d published before)",
        pc.producer_id, cursor.epoch, cursor.index, cursor.published,
    )
    return cursor


@dataclass
class _ProduceLoop:
    """The sample loop of one run; holds the pending batch and the counters."""

    config: RollstreamConfig
    rows: list[dict[str, Any]]
    cursor: ProducerCursor
    admission: Admission
    publisher: PromptPublisher
    stop: asyncio.Event
    summary: RunSummary
    batch: PendingBatch = field(default_factory=PendingBatch)

    async def run(self) -> RunSummary:
        pc, summary = self.config.producer, self.summary
        samples = iter_samples(len(self.rows), pc.epochs, pc.shuffle, pc.seed, self.cursor.epoch, self.cursor.index)
        summary.reason = "exhausted"
        for epoch, index, row_index in samples:
            if self.stop.is_set():
                summary.reason = "stopped"
                break
            if pc.max_prompts is not None and summary.total_published >= pc.max_prompts:
                summary.reason = "max_prompts"
                break
            if not await self._handle(epoch, index, row_index):
                summary.reason = "stopped"
                break
            if self.batch.is_due(pc.max_batch_prompts, pc.batch_linger_ms / 1000):
                await self._flush()
        await self._flush()  # everything admitted is published, whatever ended the loop
        summary.admission_waits = self.admission.waits
        return summary

    async def _handle(self, epoch: int, index: int, row_index: int) -> bool:
        """Admit and queue one sample; False when ``stop`` interrupted its admission."""
        pc = self.config.producer
        task_id = task_id_for(pc.producer_id, epoch, index)
        nxt_epoch, nxt_index = next_position(epoch, index, len(self.rows))
        try:
            data = with_encoded_images(self.rows[row_index])
            task = PromptTask(
                task_id=task_id, group_size=pc.group_size, data=data,
                is_eval=pc.is_eval, workflow=pc.workflow, epoch=epoch, index=index, created_at=time.time(),
            )
            value = encode(task)
            too_large = self._size_problem(task, value)
            if too_large is not None:
                raise RecordTooLargeError(too_large)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:  # RecordTooLargeError too
            self._dead_letter(task_id, row_index, exc, nxt_epoch, nxt_index)
            return True
        if not await self._admit(task_id, pc.is_eval):
            return False
        self.summary.total_published += 1
        self.batch.add_prompt(task, value, advance(self.cursor, nxt_epoch, nxt_index, self.summary.total_published))
        return True

    async def _admit(self, task_id: str, is_eval: bool) -> bool:
        while not await self.admission.try_admit(task_id, is_eval):
            if self.stop.is_set():
                return False
            # Publish what is admitted before waiting: the budget grows only when the
            # pipeline (and so the trainer) can make progress on those prompts.
            await self._flush()
            if not await self.admission.wait_for_room():
                return False
        return True

    def _size_problem(self, task: PromptTask, value: bytes) -> str | None:
        sizes = image_sizes(task.data)
        what = f"the prompt record ({len(sizes)} images of {sizes} bytes)" if sizes else "the prompt record"
        problem = size_problem(what, value, task.task_id.encode(), self.config.kafka.max_message_bytes)
        if problem is None:
            return None
        return f"{problem}; downscale its images or raise kafka.max_message_bytes (then recreate the topics)"

    def _dead_letter(self, task_id: str, row_index: int, exc: Exception, epoch: int, index: int) -> None:
        what = "is too large for the prompts topic" if isinstance(exc, RecordTooLargeError) else "cannot be encoded"
        log.error("dataset row %d (task %s) %s: %s", row_index, task_id, what, exc)
        letter = DeadLetter(
            tier=TIER, source_topic=f"dataset:{self.config.producer.dataset}", partition=-1, offset=row_index,
            key=task_id.encode(), value=None, reason=f"row {row_index} {what}: {exc}",
            error_type=type(exc).__name__, at=time.time(),
        )
        self.batch.add_dead_letter(letter, advance(self.cursor, epoch, index, self.summary.total_published))

    async def _flush(self) -> None:
        batch, self.batch = self.batch, PendingBatch()
        if batch.is_empty():
            return
        await self.publisher.commit(batch)
        summary = self.summary
        before = summary.published
        summary.published += len(batch.prompts)
        summary.eval_prompts += batch.eval_prompts
        summary.dead_lettered += len(batch.dead_letters)
        summary.transactions += 1
        every = self.config.producer.progress_every
        if summary.published // every > before // every:
            log.info(
                "producer %s: %d prompts published this run (%d total), last task %s",
                self.config.producer.producer_id, summary.published, summary.total_published,
                batch.prompts[-1][0].decode() if batch.prompts else "-",
            )

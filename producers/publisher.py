"""Publish admitted prompts together with the producer's cursor, one transaction per batch.

Prompts and the cursor that covers them commit or abort together, so after any crash the
committed cursor names exactly the first sample whose prompt was not committed. A failed
transaction (broker restarting, coordinator moved) is retried with the shared retry policy on
a new producer (the transactional core closes the failed one). Inside every transaction,
before anything is sent, the staleness budget's generation is checked (``Admission.check``):
a budget rebuilt since the producer started raises :class:`BudgetRebuilt` and nothing of the
batch is sent. A fenced producer is either the work of such a rebuild (``BudgetRebuilt``
again) or of another process started with the same ``producer.producer_id``, which stops
the tier.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer

from rollstream.producers.admission import Admission, BudgetRebuilt
from rollstream.producers.cursor import cursor_record
from rollstream.kafka.dead_letter import send_dead_letter
from rollstream.kafka.topics import TopicNames
from rollstream.kafka.transactions import TransactionalProducer, TransactionFailed, TransactionFenced
from rollstream.retry import RetryPolicy
from rollstream.runtime.metrics import DEAD_LETTERS, MESSAGES_OUT
from rollstream.wire import DeadLetter, ProducerCursor, PromptTask

log = logging.getLogger(__name__)

TIER = "producer"


@dataclass
class PendingBatch:
    """Encoded prompts (and dead letters) waiting for their transaction, plus the cursor after them."""

    prompts: list[tuple[bytes, bytes]] = field(default_factory=list)  # (key, value)
    train_task_ids: list[str] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    cursor: ProducerCursor | None = None
    first_added: float = 0.0
    eval_prompts: int = 0

    def add_prompt(self, task: PromptTask, value: bytes, cursor: ProducerCursor) -> None:
        self._touch()
        self.prompts.append((task.task_id.encode(), value))
        self.eval_prompts += task.is_eval
        if not task.is_eval:
            self.train_task_ids.append(task.task_id)
        self.cursor = cursor

    def add_dead_letter(self, letter: DeadLetter, cursor: ProducerCursor) -> None:
        self._touch()
        self.dead_letters.append(letter)
        self.cursor = cursor

    def _touch(self) -> None:
        if self.cursor is None:
            self.first_added = time.monotonic()

    def is_empty(self) -> bool:
        return self.cursor is None

    def is_due(self, max_prompts: int, linger_seconds: float) -> bool:
        """Full, or its first entry has waited ``linger_seconds``."""
        if self.is_empty():
            return False
        size = len(self.prompts) + len(self.dead_letters)
        return size >= max_prompts or time.monotonic() - self.first_added >= linger_seconds


def transactional_id(names: TopicNames, producer_id: str) -> str:
    """A producer's transactional id: one per ``producer.producer_id`` (its cursor's key)."""
    return f"{names.group_id('producer')}.{producer_id}"


class ProducerFencedError(RuntimeError):
    """Another producer process with the same ``producer.producer_id`` took over."""


class PromptPublisher:
    """Commits pending batches through a transactional producer, retrying failed transactions."""

    def __init__(self, txn: TransactionalProducer, names: TopicNames, retry: RetryPolicy, admission: Admission) -> None:
        self._txn = txn
        self._names = names
        self._retry = retry
        self._admission = admission

    async def commit(self, batch: PendingBatch) -> None:
        """Send every prompt, dead letter and the cursor in one transaction.

        A failed transaction is invisible and is retried (same content, new producer) per the
        retry policy, whose last failure propagates; :class:`BudgetRebuilt` when the budget
        was rebuilt since the producer started (nothing sent); ``ProducerFencedError`` when
        another process with the same id fenced this one.
        """
        cursor = batch.cursor
        if batch.is_empty() or cursor is None:
            return
        try:
            await self._retry.call(
                lambda: self._txn.commit(lambda producer: self._send_all(producer, batch, cursor)),
                retry_on=(TransactionFailed,), what=f"publishing {len(batch.prompts)} prompts",
            )
        except TransactionFenced as exc:
            if await self._admission.rebuilt():
                raise BudgetRebuilt(f"fenced by the staleness budget's rebuild: {exc}") from exc
            raise ProducerFencedError(
                f"another producer with producer.producer_id={cursor.producer_id!r} started and "
                "fenced this one; each producer needs its own producer_id"
            ) from exc
        MESSAGES_OUT.labels(TIER, self._names.prompts).inc(len(batch.prompts))
        MESSAGES_OUT.labels(TIER, self._names.dead_letter).inc(len(batch.dead_letters))
        DEAD_LETTERS.labels(TIER, "unencodable_row").inc(len(batch.dead_letters))
        log.debug("committed %d prompts; cursor epoch %d index %d", len(batch.prompts), cursor.epoch, cursor.index)

    async def _send_all(
        self, producer: AIOKafkaProducer, batch: PendingBatch, cursor: ProducerCursor
    ) -> list[asyncio.Future[object]]:
        if batch.train_task_ids:
            await self._admission.check()  # after the producer started: see the module docstring
        futures = [await producer.send(self._names.prompts, value, key=key) for key, value in batch.prompts]
        for letter in batch.dead_letters:
            await send_dead_letter(producer, self._names.dead_letter, letter)
        key, value = cursor_record(cursor)
        futures.append(await producer.send(self._names.producer_cursor, value, key=key))
        return futures

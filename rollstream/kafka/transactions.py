"""Kafka transactions, written once: one transactional id, its producer, and how a commit fails.

:meth:`TransactionalProducer.commit` runs ONE transaction: the caller's ``write`` sends the
records, every delivery is awaited inside the transaction, then the consumed offsets join it
(consume-transform-produce) and it commits. Failures come out as one of two errors:

- :class:`TransactionFenced`: another producer registered the same transactional id (a newer
  partition owner of the input partition, or a second process with the same id). Nothing of this
  transaction is visible and this producer can never commit again; the caller gives the
  work up. The errors that mean this are :data:`FENCED_ERRORS`.
- :class:`TransactionFailed`: anything else (broker unreachable, coordinator moved, a
  request timed out, a rejected record). The producer is CLOSED before this is raised, and
  the next commit registers the id again with a new one: aiokafka fails every later
  transaction of a producer whose transaction failed, and registering the id again bumps its
  epoch, which aborts whatever the old one left open, so nothing of the failed transaction
  is ever visible. The caller rebuilds what it sent from the committed state and tries again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    InvalidProducerEpoch,
    KafkaError,
    ProducerFenced,
    TransactionalIdAuthorizationFailed,
    UnsupportedVersionError,
)
from aiokafka.structs import TopicPartition

from rollstream.config import KafkaConfig
from rollstream.kafka.clients import make_producer, stop_client

log = logging.getLogger(__name__)

# After these this transactional id belongs to someone else (or may never be used): retrying
# cannot help, and replacing the producer would fence the rightful partition owner.
FENCED_ERRORS: tuple[type[BaseException], ...] = (
    ProducerFenced,
    InvalidProducerEpoch,
    TransactionalIdAuthorizationFailed,
    UnsupportedVersionError,
)
# Worth another try with a new producer (KafkaError covers aiokafka's protocol errors).
RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (KafkaError, OSError, asyncio.TimeoutError)
STOP_TIMEOUT_SECONDS = 5.0

Write = Callable[[AIOKafkaProducer], Awaitable[list["asyncio.Future[object]"]]]


class TransactionFenced(RuntimeError):
    """Another producer owns this transactional id now; this one can never commit again."""


class TransactionFailed(RuntimeError):
    """The transaction did not commit (nothing of it becomes visible); the producer was closed."""


class TransactionalProducer:
    """One transactional id and its current producer."""

    def __init__(self, config: KafkaConfig, client_id: str, transactional_id: str) -> None:
        self._config = config
        self._client_id = client_id
        self.transactional_id = transactional_id
        self._producer: AIOKafkaProducer | None = None

    async def start(self) -> None:
        """Register the transactional id; returns once any predecessor with the same id is
        fenced and its open transaction aborted (Kafka completes it before answering)."""
        producer = make_producer(self._config, self._client_id, transactional_id=self.transactional_id)
        try:
            await producer.start()
        except BaseException:
            await stop_client(producer, "a transactional producer", STOP_TIMEOUT_SECONDS)
            raise
        self._producer = producer

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await stop_client(producer, "a transactional producer", STOP_TIMEOUT_SECONDS)

    async def commit(
        self,
        write: Write,
        offsets: dict[TopicPartition, int] | None = None,
        group_id: str | None = None,
    ) -> None:
        """Run one transaction: ``write(producer)`` sends records and returns their delivery
        futures; ``offsets`` (with the consumer's ``group_id``) commit with them.

        Raises :class:`TransactionFenced` or :class:`TransactionFailed` (module docstring).
        """
        if self._producer is None:
            await self._start_or_fail()
        producer = self._producer
        assert producer is not None
        try:
            await producer.begin_transaction()
            futures = await write(producer)
            # Delivered before the offsets join the transaction: a broker (Kafka >= 3.6) checks
            # each produce against the transaction's coordinator, which answers "concurrent
            # transactions" while an AddOffsetsToTxn is being written, and the broker hands that
            # to aiokafka as a retried NotEnoughReplicasError (KAFKA-15459), on any number of
            # brokers. A delivery error raises inside the transaction.
            await asyncio.gather(*futures)
            if offsets:
                await producer.send_offsets_to_transaction(offsets, group_id)
            await producer.commit_transaction()
        except FENCED_ERRORS as exc:
            await self.stop()
            raise TransactionFenced(
                f"transactional id {self.transactional_id!r} was taken over ({type(exc).__name__}): "
                "another instance now owns this input"
            ) from exc
        except RETRYABLE_ERRORS as exc:
            log.warning(
                "transaction of %s failed (%s: %s); its producer is replaced",
                self.transactional_id, type(exc).__name__, exc,
            )
            await self.stop()
            raise TransactionFailed(f"transaction of {self.transactional_id!r} aborted: {type(exc).__name__}: {exc}") from exc

    async def _start_or_fail(self) -> None:
        """Start a producer; a failure is a TransactionFailed (the next commit starts one)."""
        try:
            await self.start()
        except FENCED_ERRORS as exc:
            raise TransactionFenced(f"transactional id {self.transactional_id!r} refused: {exc!r}") from exc
        except RETRYABLE_ERRORS as exc:
            raise TransactionFailed(f"cannot start the producer of {self.transactional_id!r}: {exc!r}") from exc


class PartitionProducers:
    """One :class:`TransactionalProducer` per owned input partition: ``<base>.p<partition>``.

    Fencing without KIP-447 (the design of Kafka Streams before it): output derived from input
    partition p is only ever committed under p's transactional id, and whoever takes p
    registers that id before it reads p's committed state, which fences every earlier
    partition owner.
    """

    def __init__(self, config: KafkaConfig, client_id: str, base_id: str) -> None:
        self._config = config
        self._client_id = client_id
        self._base_id = base_id
        self._producers: dict[int, TransactionalProducer] = {}

    def transactional_id(self, partition: int) -> str:
        return f"{self._base_id}.p{partition}"

    def get(self, partition: int) -> TransactionalProducer:
        producer = self._producers.get(partition)
        if producer is None:
            raise KeyError(f"input partition {partition} is not owned")
        return producer

    async def acquire(self, partition: int) -> None:
        """Register p's transactional id (fencing earlier partition owners); replaces a held one."""
        await self.release(partition)
        producer = TransactionalProducer(
            self._config, f"{self._client_id}-p{partition}", self.transactional_id(partition)
        )
        await producer.start()
        self._producers[partition] = producer

    async def release(self, partition: int) -> None:
        producer = self._producers.pop(partition, None)
        if producer is not None:
            await producer.stop()

    async def close(self) -> None:
        for partition in list(self._producers):
            await self.release(partition)

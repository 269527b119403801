"""The grouping instance's transactional producer, replaced after a failed transaction.

aiokafka's producer does not recover its idempotence state after some failures (a rejected
record leaves its sequence numbers out of order, and every later transaction fails), so a
failed transaction is not merely aborted: the producer is closed and a new one registers the
same transactional id, which bumps the epoch and aborts whatever the old one left open.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from rollstream.config import KafkaConfig
from rollstream.kafka.clients import make_producer

log = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = 5.0


class TransactionalProducer:
    """Holds the current producer (``.producer``) for one transactional id."""

    def __init__(self, config: KafkaConfig, client_id: str, transactional_id: str) -> None:
        self._config = config
        self._client_id = client_id
        self.transactional_id = transactional_id
        self._producer: AIOKafkaProducer | None = None

    @property
    def producer(self) -> AIOKafkaProducer:
        if self._producer is None:
            raise RuntimeError("the transactional producer is not started")
        return self._producer

    async def start(self) -> None:
        """Start a producer and return once its transactional id is registered: a predecessor
        with the same id is fenced and its open transaction aborted."""
        producer = make_producer(self._config, self._client_id, transactional_id=self.transactional_id)
        await producer.start()
        self._producer = producer
        await producer.begin_transaction()
        await producer.abort_transaction()

    async def replace(self) -> None:
        """Drop the current producer (its open transaction is aborted by the next one's fencing)."""
        await self.stop()
        await self.start()
        log.info("replaced the transactional producer %s", self.transactional_id)

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            await asyncio.wait_for(producer.stop(), STOP_TIMEOUT_SECONDS)
        except (KafkaError, asyncio.TimeoutError) as exc:
            log.warning("closing the failed producer: %s: %s", type(exc).__name__, exc)

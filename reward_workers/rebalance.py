"""Keep every batch transaction inside one partition assignment.

The worker holds ``BatchGuard.lock`` from the moment it starts on a fetched batch until that
batch's transaction is committed or aborted. ``on_partitions_revoked`` takes the same lock,
so a revocation waits for the batch in progress and no transaction spans a rebalance.
``generation`` changes on every revocation and assignment: a batch fetched before a
rebalance is discarded (the new assignment re-reads it from the committed offsets), so a
worker never commits offsets for partitions that moved while it was fetching.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import ConsumerRebalanceListener, TopicPartition

log = logging.getLogger(__name__)


class BatchGuard(ConsumerRebalanceListener):
    """Rebalance listener that serializes revocations with batch processing."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.generation = 0

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        async with self.lock:  # waits for the batch transaction in progress
            self.generation += 1
        if revoked:
            log.info("partitions revoked: %s", _names(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.generation += 1
        log.info("partitions assigned: %s", _names(assigned) or "none")


def _names(partitions: set[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(partitions))

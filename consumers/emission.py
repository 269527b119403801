"""One grouping cycle's output, written in ONE Kafka transaction.

The transaction holds: the batches and drop records (``batches``), an outcome per ended group
and tombstones for forgotten outcomes (``grouping-changelog``, in the source partition), dead
letters, and the new committed input offsets. Before it commits, each dropped train group's
staleness slot is returned in Redis (idempotent per task, so a drop re-decided after a crash
is not counted twice). Either all of it becomes visible to ``read_committed`` readers, or
none of it does and the consumer rebuilds its state from the committed offsets.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiokafka.structs import TopicPartition
from redis.exceptions import RedisError

from consumers.batching import build_batch, drop_record
from consumers.changelog import outcome_record
from consumers.grouping import CompleteGroup, DroppedGroup
from consumers.txn_producer import TransactionalProducer
from rollstream.kafka.dead_letter import send_dead_letter
from rollstream.kafka.topics import TopicNames
from rollstream.redis_state import StalenessBudget
from rollstream.wire import DeadLetter, encode

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_SECONDS = 2.0


@dataclass
class CycleOutput:
    """What one cycle decided; ``offsets`` maps scored partitions to their new committed offset."""

    batches: list[list[CompleteGroup]] = field(default_factory=list)
    drops: list[DroppedGroup] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    tombstones: list[tuple[str, int]] = field(default_factory=list)
    offsets: dict[int, int] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.batches or self.drops or self.dead_letters or self.tombstones or self.offsets)


class Emitter:
    """Sends a :class:`CycleOutput` inside the producer's transaction (the caller begins/commits)."""

    def __init__(
        self,
        txn: TransactionalProducer,
        names: TopicNames,
        budget: StalenessBudget,
        pad_value: float,
    ) -> None:
        self._txn = txn
        self._names = names
        self._budget = budget
        self._pad_value = pad_value
        self._group_id = names.group_id("grouping")
        self.unreleased: dict[str, str] = {}  # task -> reason, slots Redis did not take back yet

    async def send(self, out: CycleOutput, version: int) -> list[asyncio.Future[object]]:
        """Queue every record of ``out`` in the open transaction; returns the delivery futures."""
        producer = self._txn.producer
        names, send = self._names, producer.send
        futures: list[asyncio.Future[object]] = []
        for groups in out.batches:
            batch = build_batch(groups, version, self._pad_value)
            futures.append(await send(names.batches, encode(batch), key=groups[0].task_id.encode()))
            for group in groups:
                futures.append(await self._send_outcome(group))
        for drop in out.drops:
            record = encode(drop_record(drop, version))
            futures.append(await send(names.batches, record, key=drop.task_id.encode()))
            futures.append(await self._send_outcome(drop))
        for task_id, partition in out.tombstones:
            futures.append(await send(names.grouping_changelog, None, key=task_id.encode(), partition=partition))
        for letter in out.dead_letters:
            await send_dead_letter(producer, names.dead_letter, letter)
        if out.offsets:
            offsets = {TopicPartition(names.scored, p): offset for p, offset in out.offsets.items()}
            await producer.send_offsets_to_transaction(offsets, self._group_id)
        return futures

    async def _send_outcome(self, group: CompleteGroup | DroppedGroup) -> asyncio.Future[object]:
        value = encode(outcome_record(group))
        return await self._txn.producer.send(
            self._names.grouping_changelog, value, key=group.task_id.encode(), partition=group.partition
        )

    async def release_slots(self, drops: list[DroppedGroup]) -> None:
        """Return the staleness slots of dropped train groups (and of earlier failed releases).

        Redis being down never blocks emission: a failed release is kept and retried next
        cycle (and lost if this process dies first: the slot stays taken).
        """
        for drop in drops:
            if not drop.is_eval:
                self.unreleased[drop.task_id] = drop.reason
        released = 0
        for task_id, reason in list(self.unreleased.items()):
            try:
                await asyncio.wait_for(self._budget.release(task_id, reason), RELEASE_TIMEOUT_SECONDS)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                log.warning("cannot release the staleness slot of %s yet (%s); will retry", task_id, exc)
                return
            del self.unreleased[task_id]
            released += 1
        if released:
            try:
                await asyncio.wait_for(self._budget.notify(), RELEASE_TIMEOUT_SECONDS)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                log.warning("cannot notify producers of released slots: %s", exc)

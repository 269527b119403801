"""How many train groups the grouping tier has emitted: counted from the ``batches`` topic.

Redis counts what was admitted and what was dropped; groups that became training data are
counted here, so that ``rollstream status`` can show the prompts still in flight (admitted,
neither emitted nor dropped). The counter keeps its position between calls and reads only
what is new (``read_committed``, so aborted records never count); its first call reads the
topic from its beginning, within a time bound. Eval groups are not counted (they never take a
staleness slot, so they are not among the admitted either).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition

from rollstream.wire import EmittedGroup, WireDecodeError, decode_group

READ_SECONDS = 10.0  # per call; what is left is read by the next call


@dataclass
class EmittedCount:
    """Train groups emitted so far; ``complete`` is False while the topic is not read to its end."""

    groups: int
    complete: bool


@dataclass
class EmittedCounter:
    topic: str
    groups: int = 0
    positions: dict[int, int] = field(default_factory=dict)  # next offset to read per partition

    async def update(self, consumer: AIOKafkaConsumer, ends: dict[int, int], budget: float = READ_SECONDS) -> EmittedCount:
        """Read ``topic`` up to ``ends`` (or for ``budget`` seconds) with ``consumer`` (a
        ``read_committed`` consumer of its own: it is assigned the topic's partitions)."""
        tps = [TopicPartition(self.topic, p) for p in sorted(ends)]
        if not tps:
            return EmittedCount(self.groups, True)
        begins = await consumer.beginning_offsets(tps)
        consumer.assign(tps)
        try:
            for tp in tps:
                consumer.seek(tp, max(self.positions.get(tp.partition, 0), begins[tp]))
            deadline = time.monotonic() + budget
            while not await self._caught_up(consumer, tps, ends):
                if time.monotonic() > deadline:
                    return EmittedCount(self.groups, False)
                polled = await consumer.getmany(*tps, timeout_ms=200)
                for records in polled.values():
                    for record in records:
                        if record.offset < ends[record.partition]:
                            self.groups += _train_groups(record.value)
            return EmittedCount(self.groups, True)
        finally:
            for tp in tps:
                self.positions[tp.partition] = min(await consumer.position(tp), ends[tp.partition])

    @staticmethod
    async def _caught_up(consumer: AIOKafkaConsumer, tps: list[TopicPartition], ends: dict[int, int]) -> bool:
        for tp in tps:
            if await consumer.position(tp) < ends[tp.partition]:
                return False
        return True


def _train_groups(value: bytes | None) -> int:
    try:
        message = decode_group(value)
    except WireDecodeError:
        return 0  # the trainer skips it too; it is not an emitted group
    return int(isinstance(message, EmittedGroup) and not message.is_eval)

"""How many train groups the grouping tier has emitted: counted from the ``batches`` topic.

Redis counts what was admitted and what was dropped; groups that became training data are
counted here, so that ``rollstream status`` can show the prompts still in flight (admitted,
neither emitted nor dropped). The counter keeps its position between calls and reads only
what is new (``read_committed``, so aborted records never count); its first call reads the
topic from its beginning, within a time bound. Eval groups are not counted (they never take a
staleness slot, so they are not among the admitted either).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from rollstream.config import KafkaConfig
from rollstream.kafka.scan import read_bounded
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

    async def update(self, config: KafkaConfig, ends: dict[int, int], budget: float = READ_SECONDS) -> EmittedCount:
        """Read ``topic`` from where the last call stopped up to ``ends`` (the one bounded
        read), for at most ``budget`` seconds."""
        chunks = read_bounded(config, self.topic, "status-batches", partitions=ends, start=self.positions, end=ends,
                              timeout=budget)
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    self.groups += sum(_train_groups(record.value) for record in chunk.records)
                    self.positions[chunk.partition] = chunk.position
        except TimeoutError:
            return EmittedCount(self.groups, False)  # the next call reads on from here
        return EmittedCount(self.groups, True)


def _train_groups(value: bytes | None) -> int:
    try:
        message = decode_group(value)
    except WireDecodeError:
        return 0  # the trainer skips it too; it is not an emitted group
    return int(isinstance(message, EmittedGroup) and not message.is_eval)

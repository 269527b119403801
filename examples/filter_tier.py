"""A tier of your own: DAPO's overlong filtering, between the reward workers and the grouping.

A sample cut off by the length limit (``stop_reason == "length"``) becomes a rejection, so its
group still completes without it. Run it with ``rollstream tier examples.filter_tier:declare -c
CONFIG`` and set ``grouping.reads: scored-filtered`` so the grouping reads what it writes.
"""

from __future__ import annotations

from aiokafka.structs import ConsumerRecord

from rollstream.config import RollstreamConfig
from rollstream.kafka.consume_transform_produce import PartitionOutput, RecordTransform
from rollstream.tier.context import TierContext
from rollstream.tier.declaration import EXACTLY_ONCE, Reads, Tier, default_instance
from rollstream.wire import SampleRejected, ScoredEpisode, decode_scored, encode

WRITES = "scored-filtered"


class DropTruncated(RecordTransform):
    def __init__(self, topic: str) -> None:
        self.topic = topic

    async def transform(self, record: ConsumerRecord, out: PartitionOutput) -> None:
        message = decode_scored(record.value)  # raising dead-letters the record
        if isinstance(message, ScoredEpisode) and message.episode.stop_reason == "length":
            e = message.episode
            message = SampleRejected(task_id=e.task_id, sample_idx=e.sample_idx, group_size=e.group_size,
                                     is_eval=e.is_eval, reason="overlong: cut off by the length limit")
        out.send(self.topic, encode(message), record.key)


def declare(config: RollstreamConfig) -> Tier:
    async def build(ctx: TierContext) -> DropTruncated:
        return DropTruncated(ctx.names.topic(WRITES))

    return Tier("overlong-filter", default_instance(), Reads("scored"), (WRITES,), EXACTLY_ONCE, build)

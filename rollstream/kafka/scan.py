"""Read a whole topic once, from its beginning to its end as of now (read_committed).

"Its end" is each partition's last stable offset when the scan starts: committed records
only, and the scan terminates even while producers keep writing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from rollstream.config import KafkaConfig
from rollstream.kafka.clients import make_consumer, start_client

FETCH_TIMEOUT_MS = 200


async def scan_topic(config: KafkaConfig, topic: str, client_id: str) -> AsyncIterator[ConsumerRecord]:
    """Every committed record of ``topic`` up to its current end, partition by partition in
    offset order (partitions interleaved)."""
    # Subscribed without a group, aiokafka assigns every partition of the topic to this consumer.
    consumer = make_consumer(config, client_id, topic, group_id=None, read_committed=True)
    await start_client(consumer, config, f"a reader of {topic}")
    try:
        partitions = await _partitions(consumer)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        remaining = {tp for tp in partitions if ends[tp] > 0}
        while remaining:
            fetched = await consumer.getmany(*remaining, timeout_ms=FETCH_TIMEOUT_MS)
            for tp, records in fetched.items():
                for record in records:
                    if record.offset < ends[tp]:
                        yield record
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
    finally:
        await consumer.stop()


async def _partitions(consumer: AIOKafkaConsumer) -> list[TopicPartition]:
    while not consumer.assignment():  # assigned once the topic's metadata arrived
        await asyncio.sleep(0.05)
    return sorted(consumer.assignment())

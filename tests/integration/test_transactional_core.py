"""The shared consume-transform-produce core against the real broker, with a trivial transform.

``Copy`` forwards every input record to an output topic (and dead-letters the poison ones), so
what the core guarantees can be read off the output: every input record exactly once, whatever
rebalances, fencing or poison records happen meanwhile.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from aiokafka.structs import ConsumerRecord, TopicPartition

from rollstream.config import KafkaConfig
from rollstream.kafka.clients import make_consumer, make_producer
from rollstream.kafka.consume_transform_produce import ExactlyOnce, PartitionOutput, RecordTransform
from rollstream.kafka.partition_loop import PartitionLoop
from rollstream.kafka.transactions import PartitionProducers
from rollstream.retry import transaction_retry
from rollstream.wire import decode_dead_letter

pytestmark = [pytest.mark.broker, pytest.mark.timeout(240)]

PARTITIONS = 4


@dataclass
class Copy(RecordTransform):
    """Forwards each record's value; a value starting with b"poison" raises."""

    out_topic: str
    delay: float = 0.0  # per record, so a fetched batch is "in hand" for a while
    tier: str = "copy"
    concurrent: bool = True
    acquired: Counter[int] = field(default_factory=Counter)

    async def acquire(self, partitions: set[int]) -> None:
        self.acquired.update(partitions)

    async def transform(self, record: ConsumerRecord, out: PartitionOutput) -> None:
        if self.delay:
            await asyncio.sleep(self.delay * random.random())
        if record.value.startswith(b"poison"):
            raise ValueError(f"cannot copy {record.value[:20]!r}")
        out.send(self.out_topic, record.value, key=record.key)


@dataclass
class Instance:
    """One running copy loop (what a tier process would be)."""

    loop: PartitionLoop
    producers: PartitionProducers
    transform: Copy
    stop: asyncio.Event
    task: asyncio.Task[None]


async def create_topics(config: KafkaConfig, *topics: str) -> None:
    from aiokafka.admin import NewTopic

    from rollstream.kafka.clients import make_admin

    admin = make_admin(config)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(t, PARTITIONS, 1) for t in topics])
    finally:
        await admin.close()


async def start_instance(config: KafkaConfig, name: str, in_topic: str, out_topic: str, dlq: str,
                         delay: float = 0.0, max_records: int = 5) -> Instance:
    group_id = f"{in_topic}.copy"
    consumer = make_consumer(config, name, group_id=group_id, read_committed=True,
                             session_timeout_ms=6000, heartbeat_interval_ms=1000)
    transform = Copy(out_topic, delay)
    producers = PartitionProducers(config, name, base_id=group_id)
    delivery = ExactlyOnce(
        group_id=group_id, producers=producers, transform=transform, dead_letter_topic=dlq,
        max_record_bytes=config.max_message_bytes, retry=transaction_retry(10), name=name,
    )
    loop = PartitionLoop(consumer=consumer, topic=in_topic, delivery=delivery, poll_timeout_ms=100,
                         max_records=max_records, name=name, lost_partition_hold_seconds=4.0)
    loop.subscribe()
    await consumer.start()
    stop = asyncio.Event()

    async def run() -> None:
        try:
            await loop.run(stop)
        finally:
            await consumer.stop()
            await producers.close()

    return Instance(loop, producers, transform, stop, asyncio.create_task(run(), name=name))


async def produce(config: KafkaConfig, topic: str, values: list[bytes]) -> None:
    producer = make_producer(config, "feeder")
    await producer.start()
    try:
        for value in values:
            await producer.send(topic, value, key=value[-8:])
        await producer.flush()
    finally:
        await producer.stop()


async def read_values(config: KafkaConfig, topic: str) -> list[bytes]:
    consumer = make_consumer(config, "checker", group_id=None, read_committed=True)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        values: list[bytes] = []
        while any([await consumer.position(tp) < ends[tp] for tp in tps]):
            for records in (await consumer.getmany(timeout_ms=200)).values():
                values += [r.value for r in records]
        return values
    finally:
        await consumer.stop()


async def wait_for_count(config: KafkaConfig, topic: str, n: int, timeout: float) -> list[bytes]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        values = await read_values(config, topic)
        if len(values) >= n or asyncio.get_running_loop().time() > deadline:
            return values
        await asyncio.sleep(0.5)


async def stop_all(instances: list[Instance]) -> None:
    for instance in instances:
        instance.stop.set()
    await asyncio.gather(*(asyncio.wait_for(i.task, 60) for i in instances), return_exceptions=True)


async def test_rebalances_while_batches_are_in_hand_skip_and_repeat_nothing(
    kafka_bootstrap: str, unique_name: str
) -> None:
    """Instances join and leave while every instance holds fetched batches it is still
    transforming (each record takes up to 50 ms): every input record comes out once, none is
    stranded (the output completes without any further rebalance), and every partition was
    taken over at least once."""
    config = KafkaConfig(bootstrap_servers=kafka_bootstrap, transaction_timeout_ms=10000)
    in_topic, out_topic, dlq = f"{unique_name}.in", f"{unique_name}.out", f"{unique_name}.dlq"
    await create_topics(config, in_topic, out_topic, dlq)
    values = [f"rec-{i:06d}".encode() for i in range(600)]
    feeder = asyncio.create_task(produce_slowly(config, in_topic, values))
    instances = [await start_instance(config, "copy-a", in_topic, out_topic, dlq, delay=0.05)]
    try:
        for name in ("copy-b", "copy-c"):
            await asyncio.sleep(2.0)
            instances.append(await start_instance(config, name, in_topic, out_topic, dlq, delay=0.05))
        await asyncio.sleep(2.0)
        await stop_all(instances[1:2])  # one leaves while the others hold batches
        await asyncio.sleep(2.0)
        instances.append(await start_instance(config, "copy-d", in_topic, out_topic, dlq, delay=0.05))
        await feeder
        # no more membership changes from here: a stranded record would never come out
        out = await wait_for_count(config, out_topic, len(values), timeout=90)
        await asyncio.sleep(2.0)
        out = await read_values(config, out_topic)
    finally:
        feeder.cancel()
        await stop_all(instances)
    counts = Counter(out)
    assert sorted(counts) == sorted(values), f"missing {len(set(values) - set(counts))}"
    assert max(counts.values()) == 1, f"repeated: {[v for v, n in counts.items() if n > 1][:5]}"
    taken = Counter()
    for instance in instances:
        taken.update(instance.transform.acquired)
    assert all(taken[p] >= 2 for p in range(PARTITIONS)), taken


async def produce_slowly(config: KafkaConfig, topic: str, values: list[bytes]) -> None:
    for start in range(0, len(values), 50):
        await produce(config, topic, values[start:start + 50])
        await asyncio.sleep(0.5)


async def test_a_poison_record_is_dead_lettered_and_the_next_one_goes_through(
    kafka_bootstrap: str, unique_name: str
) -> None:
    config = KafkaConfig(bootstrap_servers=kafka_bootstrap, transaction_timeout_ms=10000)
    in_topic, out_topic, dlq = f"{unique_name}.in", f"{unique_name}.out", f"{unique_name}.dlq"
    await create_topics(config, in_topic, out_topic, dlq)
    producer = make_producer(config, "feeder")
    await producer.start()
    try:  # poison then good, in the SAME partition
        for value in (b"poison-1", b"good-1", b"poison-2", b"good-2"):
            await producer.send_and_wait(in_topic, value, partition=1)
    finally:
        await producer.stop()
    instance = await start_instance(config, "copy-a", in_topic, out_topic, dlq)
    try:
        out = await wait_for_count(config, out_topic, 2, timeout=60)
        letters = sorted((decode_dead_letter(v) for v in await wait_for_count(config, dlq, 2, timeout=30)),
                         key=lambda d: d.offset)
        assert not instance.task.done()
    finally:
        await stop_all([instance])
    assert sorted(out) == [b"good-1", b"good-2"]
    assert [(d.value, d.partition, d.offset, d.error_type) for d in letters] == [
        (b"poison-1", 1, 0, "ValueError"), (b"poison-2", 1, 2, "ValueError")]
    assert "cannot copy" in letters[0].reason and letters[0].tier == "copy"

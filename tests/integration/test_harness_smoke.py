"""The test harness talks to a real Kafka broker and a real Redis.

Kafka: transactions (consume-transform-produce with offsets in the transaction, commit and
abort, read_committed isolation), a broker restart under live clients, SCRAM authentication.
Redis: commands, pub/sub, a restart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from rollstream.dev.broker import LocalKafkaBroker
from rollstream.dev.launcher import DevStack


pytestmark = pytest.mark.broker

WAIT_S = 60.0


async def create_topics(bootstrap: str, *names: str, partitions: int = 1) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(n, partitions, replication_factor=1) for n in names])
    finally:
        await admin.close()


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll `check` until it returns True; fail after WAIT_S seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not await check():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def take(consumer: AIOKafkaConsumer, count: int) -> list[ConsumerRecord]:
    """The next `count` records from a started consumer."""
    records: list[ConsumerRecord] = []

    async def more() -> bool:
        for batch in (await consumer.getmany(timeout_ms=500)).values():
            records.extend(batch)
        return len(records) >= count

    await eventually(more, f"{count} records")
    return records


async def read_topic(bootstrap: str, tp: TopicPartition, isolation: str) -> list[bytes]:
    """Every value in a partition up to its end offset, as a consumer with `isolation` sees it."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level=isolation)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        values: list[bytes] = []
        while await consumer.position(tp) < end:
            for batch in (await consumer.getmany(tp, timeout_ms=500)).values():
                values.extend(record.value for record in batch)
        return values
    finally:
        await consumer.stop()


async def end_offset(bootstrap: str, tp: TopicPartition, isolation: str) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level=isolation)
    await consumer.start()
    try:
        return int((await consumer.end_offsets([tp]))[tp])
    finally:
        await consumer.stop()


async def group_offset(bootstrap: str, group: str, tp: TopicPartition) -> int | None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group, partitions=[tp])
    finally:
        await admin.close()
    found = offsets.get(tp)
    return None if found is None or found.offset < 0 else found.offset


async def test_consume_transform_produce_commit_and_abort(
    kafka_bootstrap: str, unique_name: str
) -> None:
    source, sink, group = f"{unique_name}.in", f"{unique_name}.out", f"{unique_name}.grp"
    src_tp, sink_tp = TopicPartition(source, 0), TopicPartition(sink, 0)
    await create_topics(kafka_bootstrap, source, sink)

    async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=True) as p:
        for word in (b"alpha", b"beta", b"gamma"):
            await p.send_and_wait(source, word, key=word)

    consumer = AIOKafkaConsumer(
        source, bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False,
        auto_offset_reset="earliest", isolation_level="read_committed",
    )
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, transactional_id=f"{unique_name}.txn"
    )
    await consumer.start()
    await producer.start()
    try:
        records = await take(consumer, 3)
        async with producer.transaction():
            for record in records:
                await producer.send(sink, record.value.upper(), key=record.key)
            next_offset = records[-1].offset + 1
            await producer.send_offsets_to_transaction({src_tp: next_offset}, group)

        await producer.begin_transaction()
        await producer.send_and_wait(sink, b"ABORTED")
        await producer.abort_transaction()
    finally:
        await producer.stop()
        await consumer.stop()

    # Transaction markers are written after EndTxn returns: wait until nothing is pending.
    async def stable() -> bool:
        committed = await end_offset(kafka_bootstrap, sink_tp, "read_committed")
        return committed == await end_offset(kafka_bootstrap, sink_tp, "read_uncommitted")

    await eventually(stable, "the last stable offset to reach the high watermark")
    assert await read_topic(kafka_bootstrap, sink_tp, "read_committed") == [
        b"ALPHA", b"BETA", b"GAMMA"
    ]
    assert b"ABORTED" in await read_topic(kafka_bootstrap, sink_tp, "read_uncommitted")

    async def offset_committed() -> bool:
        return await group_offset(kafka_bootstrap, group, src_tp) == next_offset

    await eventually(offset_committed, f"group offset {next_offset}")
    assert next_offset == 3


async def test_redis_commands_and_pubsub(redis_client: aioredis.Redis, unique_name: str) -> None:
    await redis_client.set(f"{unique_name}:version", 7)
    assert await redis_client.get(f"{unique_name}:version") == b"7"
    assert await redis_client.incrby(f"{unique_name}:admitted", 5) == 5

    channel = f"{unique_name}:weights"
    pubsub = redis_client.pubsub()
    await pubsub.subscribe(channel)
    try:
        await pubsub.get_message(timeout=5.0)  # the subscribe confirmation
        assert await redis_client.publish(channel, b"v8") == 1
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
        assert message is not None and message["data"] == b"v8"
    finally:
        await pubsub.aclose()


async def test_clients_continue_after_broker_restart(
    dev_stack: DevStack, kafka_bootstrap: str, unique_name: str
) -> None:
    broker = dev_stack.broker
    if broker is None:
        pytest.skip("KAFKA_BOOTSTRAP_SERVERS points at an external broker: cannot restart it")
    topic = f"{unique_name}.restart"
    await create_topics(kafka_bootstrap, topic)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=True)
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=kafka_bootstrap, group_id=f"{unique_name}.grp",
        auto_offset_reset="earliest", enable_auto_commit=False,
    )
    await producer.start()
    await consumer.start()
    try:
        await producer.send_and_wait(topic, b"before")
        assert [r.value for r in await take(consumer, 1)] == [b"before"]
        await consumer.commit()

        await asyncio.to_thread(broker.restart)
        assert broker.is_running() and broker.bootstrap == kafka_bootstrap

        await asyncio.wait_for(producer.send_and_wait(topic, b"after"), WAIT_S)
        assert [r.value for r in await take(consumer, 1)] == [b"after"]
        await asyncio.wait_for(consumer.commit(), WAIT_S)
    finally:
        await consumer.stop()
        await producer.stop()


async def test_redis_restart_keeps_address_and_loses_data(
    dev_stack: DevStack, redis_url: str, unique_name: str
) -> None:
    server = dev_stack.redis
    if server is None:
        pytest.skip("REDIS_URL points at an external Redis: cannot restart it")
    key = f"{unique_name}:k"
    before = aioredis.from_url(redis_url)
    await before.set(key, b"v")
    await before.aclose()
    await asyncio.to_thread(server.restart)
    after = aioredis.from_url(redis_url)  # same URL: the port survives the restart
    try:
        # no persistence, as documented: a restart behaves like a crash of a cache-only Redis
        assert await after.get(key) is None
        await after.set(key, b"w")
        assert await after.get(key) == b"w"
    finally:
        await after.aclose()


@pytest.mark.slow
async def test_scram_listener(dev_stack: DevStack, tmp_path: Path, unique_name: str) -> None:
    if dev_stack.broker is None:
        pytest.skip("the services are external: the local broker harness is not in use")
    broker = LocalKafkaBroker(tmp_path / "scram", heap="256m", sasl_scram_users={"alice": "s3cret"})
    await asyncio.to_thread(broker.start)
    try:
        assert broker.sasl_bootstrap is not None
        topic = f"{unique_name}.sasl"
        await create_topics(broker.bootstrap, topic)
        for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
            async with _scram_producer(broker.sasl_bootstrap, mechanism, "s3cret") as producer:
                await producer.send_and_wait(topic, mechanism.encode())
        with pytest.raises(KafkaError):
            async with _scram_producer(broker.sasl_bootstrap, "SCRAM-SHA-256", "wrong"):
                pass
        values = await read_topic(broker.bootstrap, TopicPartition(topic, 0), "read_uncommitted")
        assert values == [b"SCRAM-SHA-256", b"SCRAM-SHA-512"]
    finally:
        await asyncio.to_thread(broker.stop)


def _scram_producer(bootstrap: str, mechanism: str, password: str) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap, security_protocol="SASL_PLAINTEXT", sasl_mechanism=mechanism,
        sasl_plain_username="alice", sasl_plain_password=password, request_timeout_ms=10000,
    )


async def test_a_topic_follower_waits_for_its_topic_and_every_wait_ends(
    kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness's follower starts once its topic exists (a node may not know a topic created
    a moment ago), reads it by assignment, and its start and its stop have deadlines that name
    the topic (the 3-node cluster test once hung in a follower's stop for 600 s)."""
    from harness.ledger import TopicFollower
    from rollstream.config import KafkaConfig
    from rollstream.runtime.deadline import DeadlineExceeded

    config = KafkaConfig(bootstrap_servers=kafka_bootstrap)
    topic = f"{unique_name}-followed"
    seen: list[ConsumerRecord] = []
    follower = TopicFollower(config, topic, seen.append)
    starting = asyncio.create_task(follower.__aenter__())
    await asyncio.sleep(1.0)
    assert not starting.done()  # the topic does not exist yet: waiting, not failing
    await create_topics(kafka_bootstrap, topic)
    await asyncio.wait_for(starting, WAIT_S)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"x")
    finally:
        await producer.stop()
    await eventually(lambda: asyncio.sleep(0, len(seen) == 1), "the follower reading the record")
    await asyncio.wait_for(follower.__aexit__(), TopicFollower.STOP_SECONDS + 5)
    monkeypatch.setattr(TopicFollower, "START_SECONDS", 1.0)
    never = TopicFollower(config, f"{unique_name}-never-created", seen.append)
    with pytest.raises(DeadlineExceeded, match=f"starting the follower of {unique_name}-never-created"):
        await never.__aenter__()

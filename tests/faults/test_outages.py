"""Broker and Redis outages at start and mid-run: every tier waits them out, says so, and
exits on none shorter than ``kafka.outage_patience_seconds``.

The broker is the session's (stopped and started on the same port: ``dev_stack.broker``), so
these tests need the local one; Redis is each test's own ``redis-server`` (appendonly, so the
staleness counters survive its stops: this is about waiting, not about rebuilding them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import KafkaTimeoutError
from aiokafka.structs import TopicPartition

from harness.configs import make_config, pipeline_config
from harness.pipeline import Pipeline, write_dataset
from harness.reports import ShowReport
from harness.tiers import TierProcess
from rollstream.dev.broker import LocalKafkaBroker
from rollstream.dev.launcher import DevStack
from rollstream.dev.processes import free_port
from rollstream.dev.redis_server import LocalRedisServer
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_admin, make_consumer, make_producer, start_client
from rollstream.kafka.topics import TopicNames
from rollstream.kafka.transactions import TransactionalProducer


pytestmark = [pytest.mark.broker, pytest.mark.slow]

PATIENCE = 90.0  # the tests' kafka.outage_patience_seconds: every outage below is shorter
MID_RUN_OUTAGE = 20.0  # past the tiers' session timeouts (6-10 s): their groups notice it
WAITING_FOR_KAFKA = "cannot be reached while"


def local_broker(dev_stack: DevStack) -> LocalKafkaBroker:
    if dev_stack.broker is None:
        pytest.skip("needs the local session broker (it is stopped and started)")
    return dev_stack.broker


class Assigned(ConsumerRebalanceListener):
    def __init__(self) -> None:
        self.partitions: set[TopicPartition] = set()

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self.partitions -= set(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.partitions |= set(assigned)


@pytest.mark.timeout(300)
async def test_every_kind_of_client_starts_once_the_broker_is_back(
    kafka_bootstrap: str, redis_url: str, dev_stack: DevStack, unique_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The clients a tier starts (a group consumer subscribed with a rebalance listener, an
    idempotent producer, a transactional producer, an admin client), each started through
    ``start_client`` while the broker is down: each logs that it waits, and each is started
    and works once the broker is back (here after about 10 s)."""
    broker = local_broker(dev_stack)
    caplog.set_level(logging.WARNING, logger="rollstream.kafka.clients")
    config = make_config(kafka_bootstrap, redis_url, unique_name, {"kafka": {"outage_patience_seconds": PATIENCE}})
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    kafka = config.kafka
    consumer = make_consumer(kafka, "outage-consumer", group_id=f"{unique_name}-group")
    listener = Assigned()
    consumer.subscribe([names.prompts], listener=listener)
    producer = make_producer(kafka, "outage-producer")
    txn = TransactionalProducer(kafka, "outage-txn", f"{unique_name}-txn")
    admin = make_admin(kafka, "outage-admin")
    clients = {"group consumer": consumer, "producer": producer, "transactional producer": txn, "admin": admin}
    await asyncio.to_thread(broker.stop)
    started: dict[str, asyncio.Task[None]] = {}
    try:
        started = {what: asyncio.create_task(start_client(client, kafka, what)) for what, client in clients.items()}
        await _until(lambda: all(_logged(caplog, f"while starting {what}") for what in clients), 60,
                     "every client to say it waits for kafka")
        await asyncio.sleep(8.0)  # a few more failed tries each
        assert not any(task.done() for task in started.values()), {w: t for w, t in started.items() if t.done()}
        down_for = time.monotonic()
    finally:
        await asyncio.to_thread(broker.start)
    down_for = time.monotonic() - down_for
    try:
        await asyncio.wait_for(asyncio.gather(*started.values()), 120)
        record = await producer.send_and_wait(names.prompts, b"after the outage", key=b"k")
        await txn.commit(lambda p: _send_one(p, names.prompts))
        assert names.prompts in await admin.list_topics()
        await _until(lambda: bool(listener.partitions), 60, "the group consumer's assignment")
        tp = TopicPartition(names.prompts, record.partition)
        assert await _read_until(consumer, tp, b"after the outage")
    finally:
        await consumer.stop()
        await producer.stop()
        await txn.stop()
        await admin.close()
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) >= 4 * 2, retries  # each client tried more than once, each try logged
    assert down_for < PATIENCE


async def test_an_outage_longer_than_the_patience_ends_the_start_naming_the_setting(
    unique_name: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing listens at the bootstrap address: the start gives up once the failures went on
    for the patience (not before), with an error that names the setting and the last error."""
    caplog.set_level(logging.WARNING, logger="rollstream")
    config = make_config(f"127.0.0.1:{free_port()}", "redis://127.0.0.1:1/0", unique_name,
                         {"kafka": {"outage_patience_seconds": 2.0}})
    consumer = make_consumer(config.kafka, "outage-consumer", group_id=f"{unique_name}-group")
    began = time.monotonic()
    with pytest.raises(KafkaTimeoutError, match=r"not ready after 2s .* while starting a consumer "
                                                 r"\(kafka.outage_patience_seconds\); last error: KafkaConnectionError"):
        await start_client(consumer, config.kafka, "a consumer")
    assert time.monotonic() - began >= 2.0
    assert _logged(caplog, "waiting up to 2s for it (kafka.outage_patience_seconds)")
    assert len([r for r in caplog.records if "retrying in" in r.getMessage()]) >= 2


async def _send_one(producer: object, topic: str) -> list[asyncio.Future[object]]:
    return [await producer.send(topic, b"in a transaction", key=b"k")]  # type: ignore[attr-defined]


async def _read_until(consumer: AIOKafkaConsumer, tp: TopicPartition, value: bytes, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for records in (await consumer.getmany(tp, timeout_ms=500)).values():
            if any(r.value == value for r in records):
                return True
    return False


def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)


async def _until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.2)


TIERS = {"producer": "producer", "rollout": "rollout-worker", "reward": "reward-worker",
         "grouping": "grouping", "dump": "dump"}


@pytest.mark.timeout(720)
async def test_no_tier_exits_on_broker_and_redis_outages_shorter_than_its_patience(
    kafka_bootstrap: str, dev_stack: DevStack, unique_name: str, tiny_model: Path, tmp_path: Path,
    show_report: ShowReport,
) -> None:
    """Every tier (producer, rollout worker, reward worker, grouping, dump) started as its own
    process while BOTH the broker and Redis are down, then:

    1. the broker comes back (Redis still down): every tier gets past its topics; the rollout
       worker then waits for Redis, BEFORE it starts its Kafka clients;
    2. the broker goes down again, then Redis comes back: the rollout worker starts its
       producer and consumer while the broker is down (the case of a tier restarted shortly
       before a broker outage) and waits in ``start_client``;
    3. the broker comes back; at 25% of the groups ended Redis is stopped for 20 s, at 50% the
       broker is stopped for 20 s (the producer still waits for room then).

    No tier exits unasked (the harness would restart it and count it), every tier logs its
    waits, and every admitted prompt ends exactly once with one staleness slot each.
    """
    broker = local_broker(dev_stack)
    prompts = 48
    redis = LocalRedisServer(tmp_path / "redis", appendonly=True)
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts)
    tree = pipeline_config(kafka_bootstrap, redis.url, unique_name, tiny_model, dataset, prompts)
    tree["kafka"]["outage_patience_seconds"] = PATIENCE
    tree["rollout"]["fileroot"] = str(tmp_path / "dumps")
    tree["dump"] = {"fields": "extended"}  # the dump tier reads Redis too
    pipeline = Pipeline(tree, tmp_path, tiny_model)
    for name, tier in TIERS.items():
        pipeline.add(name, tier)
    phases: list[str] = []
    began = time.monotonic()

    def phase(text: str) -> None:
        phases.append(f"{time.monotonic() - began:5.0f}s {text}")

    await asyncio.to_thread(broker.stop)
    try:
        for process in pipeline.tiers.values():
            process.start()
        phase("broker and redis down; every tier started")
        await _supervised(pipeline, lambda: all(p.grep(WAITING_FOR_KAFKA) for p in pipeline.tiers.values()), 120,
                          "every tier to say it waits for kafka")
        phase("every tier waits for kafka")
        await asyncio.to_thread(broker.start)
        phase("broker up (redis down)")
        rollout = pipeline.tiers["rollout"]
        await _supervised(pipeline, lambda: bool(rollout.grep("redis ping failed")), 120,
                          "the rollout worker to wait for redis")
        phase("the rollout worker waits for redis, its kafka clients not started")
        await asyncio.to_thread(broker.stop)
        phase("broker down")
        await asyncio.to_thread(redis.start)
        phase("redis up (broker down)")
        await _supervised(pipeline, lambda: bool(rollout.grep("starting the producer of rollout-worker")), 120,
                          "the rollout worker to wait for kafka in start_client")
        phase("the rollout worker waits for kafka to start its producer")
        await pipeline.sleep(5.0)
    finally:
        if not broker.is_running():
            await asyncio.to_thread(broker.start)
    phase("broker up")
    async with pipeline:
        # both while the producer still waits for room (it needs version 4 for its last prompts)
        await pipeline.wait_for(lambda: pipeline.progress() >= 0.25, 300, "25% of the groups")
        phase(f"redis down for {MID_RUN_OUTAGE:.0f}s at {pipeline.progress():.0%}")
        producer_alive = pipeline.tiers["producer"].running()
        redis.stop()
        try:
            await pipeline.sleep(MID_RUN_OUTAGE)
        finally:
            await asyncio.to_thread(redis.start)
        phase("redis up")
        await pipeline.wait_for(lambda: pipeline.progress() >= 0.5, 300, "50% of the groups")
        phase(f"broker down for {MID_RUN_OUTAGE:.0f}s at {pipeline.progress():.0%}")
        await asyncio.to_thread(broker.stop)
        try:
            await pipeline.sleep(MID_RUN_OUTAGE)
        finally:
            await asyncio.to_thread(broker.start)
        phase("broker up")
        await pipeline.wait_for(pipeline.finished, 300, "every admitted prompt to end")
        outcome = await pipeline.outcome()
    redis.stop()
    waits = {name: _waits(process) for name, process in pipeline.tiers.items()}
    text = "\n".join([
        "== outages at start and mid-run", *phases,
        f"admitted {outcome.admitted}, emitted {outcome.emitted}, dropped {outcome.dropped}, "
        f"duplicates {outcome.duplicate_tasks}/{outcome.duplicate_rows}, budget {outcome.budget}",
        f"unexpected exits {outcome.unexpected_exits or 'none'}",
        *(f"{name}: {counts}" for name, counts in waits.items()),
    ])
    show_report(text)
    assert not outcome.unexpected_exits, text + "\n" + "\n".join(p.tail(40) for p in pipeline.tiers.values())
    assert not outcome.problems, "\n".join(outcome.problems) + "\n" + text
    assert outcome.admitted == prompts and outcome.budget["admitted"] == prompts, text
    for name in TIERS:
        assert waits[name]["kafka"] > 0, f"{name} never said it waits for kafka\n{text}"
    assert producer_alive and waits["rollout"]["redis"] > 0 and waits["producer"]["redis"] > 0, text


async def _supervised(pipeline: Pipeline, predicate: object, timeout: float, what: str) -> None:
    """Like ``pipeline.wait_for`` before the pipeline's own clients run (no watcher yet)."""
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        for name, process in pipeline.tiers.items():
            code = process.exit_code()
            if code is not None:
                pytest.fail(f"{name} exited with {code} while waiting for {what}\n{process.tail(40)}")
        if time.monotonic() > deadline:
            tails = "\n".join(p.tail(15) for p in pipeline.tiers.values())
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")
        await asyncio.sleep(0.25)


def _waits(process: TierProcess) -> dict[str, int]:
    """How many log lines of a tier say it waits for kafka or for redis."""
    lines = process.grep("WARNING")
    kafka = [line for line in lines if WAITING_FOR_KAFKA in line or ("retrying in" in line and "kafka at" in line)]
    redis = [line for line in lines if "redis" in line.lower() or "staleness budget unreachable" in line
             or "version store unreachable" in line]
    return {"kafka": len(kafka), "redis": len(redis)}

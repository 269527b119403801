"""The rollout workers' consumer group settles: one join is one round, on the real broker.

The consumers are the rollout worker's own (``tier_consumer`` of its declaration, the strategy list of
``rollstream.kafka.assignors``). aiokafka sends one JoinGroup per strategy a consumer names,
and each one after the first changes the member's protocols once the round has completed, so
the group rebalances again (aio-libs/aiokafka#1168); several members doing that kept groups
rebalancing for minutes. Asserted through the generation the broker gave each member (read
from aiokafka's coordinator: the public API does not expose it).
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer

from harness.configs import make_config
from rollstream.config import RollstreamConfig
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.topics import TopicNames
from rollstream.rollout_workers.service import declare
from rollstream.tier.runtime import tier_consumer


pytestmark = pytest.mark.broker


def _config(kafka_bootstrap: str, redis_url: str, name: str) -> RollstreamConfig:
    return make_config(kafka_bootstrap, redis_url, name, {"kafka": {"partitions": 6}})


def _generation(consumer: AIOKafkaConsumer) -> int:
    return int(consumer._coordinator.generation)  # noqa: SLF001 (no public accessor)


async def _start(config: RollstreamConfig, worker_id: str) -> AIOKafkaConsumer:
    names = TopicNames.of(config)
    config = msgspec.structs.replace(config, rollout=msgspec.structs.replace(config.rollout, worker_id=worker_id))
    consumer = tier_consumer(declare(config), config, names)
    consumer.subscribe([names.prompts])
    await consumer.start()
    return consumer


async def _settled(consumers: list[AIOKafkaConsumer], partitions: int, quiet: float, timeout: float = 60) -> list[int]:
    """Wait until every partition is assigned to exactly one consumer and no generation moved
    for ``quiet`` seconds; the generations then. (The consumers' background tasks join and
    heartbeat; nothing here needs to fetch.)"""
    deadline = time.monotonic() + timeout
    last: list[int] = []
    since = time.monotonic()
    while True:
        await asyncio.sleep(0.1)
        now = [_generation(c) for c in consumers]
        owned = [tp.partition for c in consumers for tp in c.assignment()]
        if now != last:
            last, since = now, time.monotonic()
        if sorted(owned) == list(range(partitions)) and len(set(now)) == 1 and time.monotonic() - since >= quiet:
            return now
        assert time.monotonic() < deadline, f"not settled after {timeout}s: generations {now}, partitions {sorted(owned)}"


async def test_a_lone_worker_joins_in_one_round(kafka_bootstrap: str, redis_url: str, unique_name: str) -> None:
    config = _config(kafka_bootstrap, redis_url, unique_name)
    await ensure_topics(config.kafka, TopicNames.of(config))
    consumer = await _start(config, "w0")
    try:
        assert await _settled([consumer], 6, quiet=3.0) == [1]  # a second JoinGroup would make it 2
    finally:
        await consumer.stop()


async def test_workers_starting_together_settle_at_once(kafka_bootstrap: str, redis_url: str, unique_name: str) -> None:
    """Three workers of one process start at the same moment; the group settles within a few
    generations and stays there."""
    config = _config(kafka_bootstrap, redis_url, unique_name)
    await ensure_topics(config.kafka, TopicNames.of(config))
    consumers = await asyncio.gather(*(_start(config, f"w{i}") for i in range(3)))
    try:
        generations = await _settled(list(consumers), 6, quiet=5.0)
        assert generations[0] <= 3, generations
        assert all(len(c.assignment()) == 2 for c in consumers), [sorted(c.assignment()) for c in consumers]
    finally:
        await asyncio.gather(*(c.stop() for c in consumers))

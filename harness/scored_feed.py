"""Scored episodes written to, and outcomes read from, the grouping tier's topics."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import msgspec
import pytest
from aiokafka import TopicPartition

from harness.episodes import scored
from rollstream.config import RollstreamConfig
from rollstream.kafka.clients import make_consumer, make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.wire import encode


async def write_scored(config: RollstreamConfig, items: Iterable[tuple[msgspec.Struct | bytes, int]]) -> None:
    """Write ``(message or raw bytes, partition)`` pairs to ``scored``, in order."""
    producer = make_producer(config.kafka, "test-writer")
    await producer.start()
    try:
        for item, partition in items:
            value = item if isinstance(item, bytes) else encode(item)
            key = b"junk" if isinstance(item, bytes) else task_of(item).encode()
            await producer.send_and_wait(TopicNames.of(config).scored, value, key=key, partition=partition)
    finally:
        await producer.stop()


async def read_all(config: RollstreamConfig, topic: str, until: int, settle_s: float = 2.0) -> list:
    """Every committed record of ``topic`` once at least ``until`` arrived (waiting ``settle_s``
    more, so duplicates would show). Values decoded with decode_group (raw for other topics)."""
    consumer = make_consumer(config.kafka, "test-reader", group_id=None, read_committed=True)
    await consumer.start()
    records: list = []
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(config.kafka.partitions)])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        settled_at: float | None = None
        while settled_at is None or loop.time() < settled_at:
            for batch in (await consumer.getmany(timeout_ms=300)).values():
                records.extend(batch)
            if settled_at is None and len(records) >= until:
                settled_at = loop.time() + settle_s
            if loop.time() > deadline:
                pytest.fail(f"only {len(records)} of {until} records on {topic} after {WAIT_S}s")
    finally:
        await consumer.stop()
    return records


def group_messages(task: str, size: int = 4, version: int = 1) -> list[msgspec.Struct]:
    return [scored(task, i, size, reward=float(i % 2), version=version, gen_len=1 + i) for i in range(size)]


WAIT_S = 90.0



def task_of(message: msgspec.Struct) -> str:
    return message.episode.task_id if hasattr(message, "episode") else message.task_id

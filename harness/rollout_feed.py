"""What the rollout worker's integration tests share: topic names, publishing prompts, reading a
topic as it fills, stopping an in-process worker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from rollstream.config import RollstreamConfig
from rollstream.kafka.clients import make_consumer, make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.wire import PromptTask, encode



async def publish_prompts(config: RollstreamConfig, *records: PromptTask | tuple[bytes, bytes]) -> dict[bytes, tuple[int, int]]:
    """Prompts (or raw ``(key, value)`` records) to the prompts topic, without a transaction.

    Returns each key's ``(partition, offset)``.
    """
    producer = make_producer(config.kafka, "test-prompts")
    await producer.start()
    placed: dict[bytes, tuple[int, int]] = {}
    try:
        for record in records:
            key, value = (record.task_id.encode(), encode(record)) if isinstance(record, PromptTask) else record
            meta = await producer.send_and_wait(TopicNames.of(config).prompts, value, key=key)
            placed[key] = (meta.partition, meta.offset)
    finally:
        await producer.stop()
    return placed


class TopicReader:
    """Reads a topic from the start (read_committed) and keeps every decoded message."""

    def __init__(self, config: RollstreamConfig, topic: str, decode: Callable[[bytes], Any]) -> None:
        self.consumer = make_consumer(config.kafka, "test-reader", topic, group_id=None)
        self.decode = decode
        self.messages: list[Any] = []

    async def __aenter__(self) -> TopicReader:
        await self.consumer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.stop()

    async def until(self, done: Callable[[list[Any]], bool], timeout: float,
                    what: str | Callable[[], str]) -> list[Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done(self.messages):
            if loop.time() > deadline:
                text = what if isinstance(what, str) else what()
                pytest.fail(f"timed out waiting for {text}; have {len(self.messages)} messages")
            for batch in (await self.consumer.getmany(timeout_ms=200)).values():
                self.messages.extend(self.decode(r.value) for r in batch)
        return self.messages


    async def drain(self, idle_ms: int = 1000) -> None:
        """Read until nothing new arrives for ``idle_ms``."""
        while batches := await self.consumer.getmany(timeout_ms=idle_ms):
            for batch in batches.values():
                self.messages.extend(self.decode(r.value) for r in batch)


async def stop_worker(task: asyncio.Task[None], stop: asyncio.Event) -> None:
    stop.set()
    await asyncio.wait_for(task, 60)

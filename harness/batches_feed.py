"""Complete groups written straight to the batches topic, for the trainer-side tests."""

from __future__ import annotations

import msgspec

from harness.episodes import scored
from rollstream.config import RollstreamConfig
from rollstream.consumers.grouping.groups import CompleteGroup
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.wire import encode


def group(task: str, gen_len: int = 2, is_eval: bool = False) -> CompleteGroup:
    eps = tuple(scored(task, i, 2, reward=float(i), gen_len=gen_len + i, version=1, is_eval=is_eval) for i in range(2))
    return CompleteGroup(task, 2, is_eval, eps, 0, 0, 0, 0, 0.0)


async def write_batches(config: RollstreamConfig, messages: list[msgspec.Struct | bytes]) -> None:
    names = TopicNames.of(config)
    producer = make_producer(config.kafka, "test-batches")
    await producer.start()
    try:
        for message in messages:
            value = message if isinstance(message, bytes) else encode(message)
            await producer.send_and_wait(names.batches, value, key=b"k", partition=0)
    finally:
        await producer.stop()

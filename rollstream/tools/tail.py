"""Print a topic's messages as they arrive: one summary line each, or JSON.

Reads ``read_committed`` without a consumer group (it never moves any tier's offsets).
Undecodable records are printed as ``undecodable p<partition>@<offset>: <reason>``.
With ``stop_at_end`` it captures each partition's end (the last stable offset) when it starts
and returns once it has read up to there: ``--from-beginning --stop-at-end`` prints what a
topic holds and exits, however few messages that is.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TextIO

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from rollstream.config import RollstreamConfig
from rollstream.dump.lines import Tokenizer, load_tokenizer
from rollstream.kafka.clients import make_consumer
from rollstream.kafka.scan import scan_topic
from rollstream.kafka.topics import TopicNames
from rollstream.tools.render import message_json, summary_line
from rollstream.kafka.admin import topic_partitions
from rollstream.tools.roles import decode_record, topic_for
from rollstream.wire import WireDecodeError

POLL_MS = 500


@dataclass
class TailOptions:
    from_beginning: bool = False
    max_messages: int | None = None  # exit after printing this many
    as_json: bool = False  # whole message as JSON, tensors summarized
    tokenizer_path: str | None = None  # show prompt and completion text of episodes
    wait_seconds: float = 30.0  # how long to wait for the topic to exist
    stop_at_end: bool = False  # exit once the end offsets captured at start are reached


async def tail(
    config: RollstreamConfig, role: str, options: TailOptions,
    out: TextIO | None = None, stop: asyncio.Event | None = None,
) -> int:
    """Print messages of ``role`` until ``stop`` is set, ``max_messages`` are printed, or (with
    ``stop_at_end``) the topic's end at start is reached; returns how many were printed."""
    out = out or sys.stdout
    names = TopicNames.of(config)
    topic = topic_for(names, role)
    tokenizer = await asyncio.to_thread(load_tokenizer, options.tokenizer_path) if options.tokenizer_path else None
    partitions = await _wait_for_topic(config, topic, options.wait_seconds)
    printed = 0
    records = _to_end(config, topic, partitions, options) if options.stop_at_end else _follow(config, topic, partitions, options, stop)
    async with contextlib.aclosing(records):
        async for record in records:
            out.write(_render(role, record.value, record.partition, record.offset, options, tokenizer) + "\n")
            out.flush()  # a follower shows each message as it arrives
            printed += 1
            if (options.max_messages is not None and printed >= options.max_messages) or (stop is not None and stop.is_set()):
                break
    return printed


async def _wait_for_topic(config: RollstreamConfig, topic: str, wait_seconds: float) -> list[int]:
    """The topic's partitions, once it exists; ``RuntimeError`` after ``wait_seconds``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_seconds
    while (partitions := await topic_partitions(config.kafka, topic)) is None:
        if loop.time() > deadline:
            raise RuntimeError(f"topic {topic} did not exist within {wait_seconds:.0f}s "
                               "(check experiment.experiment_name / trial_name)")
        await asyncio.sleep(0.5)
    return partitions


def _to_end(config: RollstreamConfig, topic: str, partitions: list[int], options: TailOptions) -> AsyncIterator[ConsumerRecord]:
    """What the topic holds now (the one bounded read; from the end: nothing). A partition that
    makes no progress for ``wait_seconds`` ends the read with a ``TimeoutError`` naming it."""
    start = None if options.from_beginning else dict.fromkeys(partitions, sys.maxsize)  # past every end
    return scan_topic(config.kafka, topic, "tail", partitions=partitions, start=start, stall_seconds=options.wait_seconds)


async def _follow(
    config: RollstreamConfig, topic: str, partitions: list[int], options: TailOptions, stop: asyncio.Event | None,
) -> AsyncIterator[ConsumerRecord]:
    """Every record as it arrives, until ``stop`` is set (a follower has no end to wait for)."""
    consumer = make_consumer(config.kafka, "tail", group_id=None, read_committed=True)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        await (consumer.seek_to_beginning(*tps) if options.from_beginning else consumer.seek_to_end(*tps))
        while not (stop is not None and stop.is_set()):
            polled = await consumer.getmany(timeout_ms=POLL_MS)
            for tp in sorted(polled, key=lambda t: t.partition):
                for record in polled[tp]:
                    yield record
    finally:
        await consumer.stop()


def _render(
    role: str, value: bytes | None, partition: int, offset: int, options: TailOptions, tokenizer: Tokenizer | None
) -> str:
    try:
        message = decode_record(role, value)
    except WireDecodeError as exc:
        return f"undecodable p{partition}@{offset}: {exc.reason}"
    if options.as_json:
        return message_json(message, "summary").decode()
    return f"p{partition}@{offset} {summary_line(message, tokenizer)}"

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
from dataclasses import dataclass
from typing import TextIO

from aiokafka import AIOKafkaConsumer, TopicPartition

from rollstream.config import RollstreamConfig
from rollstream.dump.lines import Tokenizer, load_tokenizer
from rollstream.kafka.clients import make_consumer
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
    names = TopicNames(config.experiment.experiment_name, config.experiment.trial_name)
    topic = topic_for(names, role)
    tokenizer = await asyncio.to_thread(load_tokenizer, options.tokenizer_path) if options.tokenizer_path else None
    printed = 0
    async with contextlib.AsyncExitStack() as stack:
        consumer = make_consumer(config.kafka, "tail", group_id=None, read_committed=True)
        await consumer.start()
        stack.push_async_callback(consumer.stop)
        tps = await _assign(config, consumer, topic, options)
        if tps is None:
            raise RuntimeError(f"topic {topic} does not exist (check experiment.experiment_name / trial_name)")
        ends = await consumer.end_offsets(tps) if options.stop_at_end else None
        while not (stop is not None and stop.is_set()):
            if ends is not None and await _reached(consumer, ends):
                break
            polled = await consumer.getmany(timeout_ms=POLL_MS)
            for tp in sorted(polled, key=lambda t: t.partition):
                for record in polled[tp]:
                    if ends is not None and record.offset >= ends[tp]:
                        continue  # written after the start: not this run's to print
                    out.write(_render(role, record.value, record.partition, record.offset, options, tokenizer) + "\n")
                    printed += 1
                    if options.max_messages is not None and printed >= options.max_messages:
                        out.flush()
                        return printed
            out.flush()
    return printed


async def _reached(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> bool:
    """True once every partition's position is at or past its captured end offset."""
    for tp, end in ends.items():
        if await consumer.position(tp) < end:
            return False
    return True


async def _assign(
    config: RollstreamConfig, consumer: AIOKafkaConsumer, topic: str, options: TailOptions
) -> list[TopicPartition] | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + options.wait_seconds
    while (partitions := await topic_partitions(config.kafka, topic)) is None:
        if loop.time() > deadline:
            return None
        await asyncio.sleep(0.5)
    tps = [TopicPartition(topic, p) for p in partitions]
    consumer.assign(tps)
    if options.from_beginning:
        await consumer.seek_to_beginning(*tps)
    else:
        await consumer.seek_to_end(*tps)
    return tps


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

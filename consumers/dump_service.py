"""The dump tier: reads ``scored`` in its own consumer group and writes trajectory dumps.

Each poll's lines are merged into their files before the poll's offsets are committed, so a
crash never loses a line. Records re-read after a crash change nothing: a task's file keeps
one line per ``(sample_idx, row)`` (:mod:`rollstream.dump.files`). Undecodable records go to
the dead-letter topic (delivered before the commit) and the tier keeps running. Line format:
:mod:`rollstream.dump.lines`; with ``dump.fields: extended`` the tier reads the trainer version and
weight paths from Redis.

One writer per sample: with ``rollout.dump_to_file`` true the rollout workers write the
dumps, and this tier refuses to start (:func:`check_single_writer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import CommitFailedError
from aiokafka.structs import ConsumerRecord

from rollstream.config import ConfigError, RollstreamConfig
from rollstream.dump.lines import DumpWriter
from rollstream.runtime.health import mark_ready
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer, make_producer, start_client, stop_client
from rollstream.kafka.dead_letter import dead_letter_for, send_dead_letter
from rollstream.kafka.topics import TopicNames
from rollstream.runtime.metrics import DEAD_LETTERS, EPISODES, MESSAGES_IN, MESSAGES_OUT
from rollstream.state.client import RedisKeys, connect
from rollstream.state.versions import VersionStore
from rollstream.wire import ScoredEpisode, WireDecodeError, decode_scored

log = logging.getLogger(__name__)

TIER = "dump"
POLL_TIMEOUT_MS = 500


def check_single_writer(config: RollstreamConfig) -> None:
    """``ConfigError`` when the rollout workers write the dumps themselves."""
    if config.rollout.dump_to_file:
        raise ConfigError(
            "rollout.dump_to_file is true: the rollout workers write the trajectory dumps, and the "
            "dump tier would write every sample a second time. Set rollout.dump_to_file=false to "
            "let the dump tier write them, or do not run the dump tier."
        )


async def run(config: RollstreamConfig, stop: asyncio.Event) -> None:
    """Dump every scored episode until ``stop`` is set; commits after each flushed poll."""
    check_single_writer(config)
    names = TopicNames(config.experiment.experiment_name, config.experiment.trial_name)
    exp = config.experiment
    async with contextlib.AsyncExitStack() as stack:
        versions = None
        if config.dump.fields == "extended":  # trainer version and weight paths live in Redis
            redis = connect(config.redis)
            stack.push_async_callback(redis.aclose)
            versions = VersionStore(redis, RedisKeys(exp.experiment_name, exp.trial_name))
        # fails early, naming the setting, without a tokenizer
        writer = DumpWriter.from_config(config, versions=versions)
        await ensure_topics(config.kafka, names)
        consumer = make_consumer(
            config.kafka, TIER, names.scored, group_id=names.group_id(TIER), read_committed=True
        )
        await start_client(consumer, config.kafka, "the dump tier's consumer")
        stack.push_async_callback(stop_client, consumer, "the consumer of the dump tier")
        producer = make_producer(config.kafka, TIER)
        await start_client(producer, config.kafka, "the dump tier's dead-letter producer")
        stack.push_async_callback(stop_client, producer, "the producer of the dump tier")
        stack.push_async_callback(writer.close)
        log.info("dump tier consuming %s as group %s, writing to %s", names.scored, names.group_id(TIER),
                 writer.root / writer.experiment / writer.trial)
        mark_ready()
        while not stop.is_set():
            polled = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
            if polled:
                await _handle_poll(polled, consumer, producer, writer, names)


async def _handle_poll(
    polled: dict[TopicPartition, list[ConsumerRecord]],
    consumer: AIOKafkaConsumer,
    producer: AIOKafkaProducer,
    writer: DumpWriter,
    names: TopicNames,
) -> None:
    task_ids: list[str] = []
    for records in polled.values():
        for record in records:
            task_id = await _handle_record(record, producer, writer, names)
            if task_id is not None:
                task_ids.append(task_id)
    await writer.flush()
    await producer.flush()  # dead letters are delivered before their offsets are committed
    offsets = {tp: records[-1].offset + 1 for tp, records in polled.items() if records}
    try:
        await consumer.commit(offsets)
    except CommitFailedError as exc:
        # A rebalance took the partitions away: their new owner re-reads these records, and
        # their lines, already in the files, are skipped.
        log.warning("commit failed after a rebalance (%s); the new owner re-reads these records", exc)
    if task_ids:
        shown = ", ".join(sorted(set(task_ids))[:8])
        log.info("dumped %d episode(s) of task(s) %s%s", len(task_ids), shown, "..." if len(set(task_ids)) > 8 else "")


async def _handle_record(
    record: ConsumerRecord, producer: AIOKafkaProducer, writer: DumpWriter, names: TopicNames
) -> str | None:
    """Dump one record (or dead-letter it); returns the dumped episode's task id."""
    MESSAGES_IN.labels(TIER, "scored").inc()
    try:
        message = decode_scored(record.value)
    except WireDecodeError as exc:
        DEAD_LETTERS.labels(TIER, "undecodable").inc()
        letter = dead_letter_for(record, TIER, exc.reason, exc)
        await send_dead_letter(producer, names.dead_letter, letter)
        MESSAGES_OUT.labels(TIER, "dead-letter").inc()
        return None
    if not isinstance(message, ScoredEpisode):
        return None  # rejections and failures have no trajectory to dump
    await writer.write(message)
    EPISODES.labels(TIER, "dumped").inc()
    return message.episode.task_id

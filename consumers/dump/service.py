"""The dump tier: reads ``scored`` in its own consumer group and writes trajectory dumps.

The tier is the one partition loop (:mod:`rollstream.kafka.partition_loop`) with the
at-least-once delivery around a :class:`DumpIntake`: each cycle's lines are merged into their
files, and its dead letters delivered, before the cycle's offsets are committed, so a crash
never loses a line; a partition that moves away commits what was written of it first. Records
re-read after a crash or a rebalance change nothing: a task's file keeps one line per
``(sample_idx, row)`` (:mod:`rollstream.dump.files`). Undecodable records go to the
dead-letter topic and the tier keeps running. Line format: :mod:`rollstream.dump.lines`; with
``dump.fields: extended`` the tier reads the trainer version and weight paths from Redis.

One writer per sample: with ``rollout.dump_to_file`` true the rollout workers write the
dumps, and this tier refuses to start (:func:`check_single_writer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from rollstream.config import ConfigError, RollstreamConfig
from rollstream.dump.lines import DumpWriter
from rollstream.runtime.health import mark_ready
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer, make_producer, start_client, stop_client
from rollstream.kafka.dead_letter import dead_letter_for, send_dead_letter
from rollstream.kafka.partition_loop import AtLeastOnce, PartitionLoop, Records
from rollstream.kafka.topics import TopicNames
from rollstream.retry import KAFKA_RETRY
from rollstream.runtime.metrics import DEAD_LETTERS, EPISODES, MESSAGES_IN, MESSAGES_OUT
from rollstream.state.client import RedisKeys, connect
from rollstream.state.version_store import VersionStore
from rollstream.wire import ScoredEpisode, WireDecodeError, decode_scored

log = logging.getLogger(__name__)

TIER = "dump"
POLL_TIMEOUT_MS = 500
COMMIT_EVERY_CYCLE = 0.0  # the loop's commit interval: each cycle's written offsets


def check_single_writer(config: RollstreamConfig) -> None:
    """``ConfigError`` when the rollout workers write the dumps themselves."""
    if config.rollout.dump_to_file:
        raise ConfigError(
            "rollout.dump_to_file is true: the rollout workers write the trajectory dumps, and the "
            "dump tier would write every sample a second time. Set rollout.dump_to_file=false to "
            "let the dump tier write them, or do not run the dump tier."
        )


class DumpIntake:
    """The dump tier's side of its partition loop: the records taken in a cycle are written
    (files flushed, dead letters delivered) at the cycle's end; then their offsets are done."""

    def __init__(self, writer: DumpWriter, producer: AIOKafkaProducer, names: TopicNames) -> None:
        self._writer = writer
        self._producer = producer
        self._names = names
        self._owned: set[int] = set()
        self._taken: Records = {}
        self._done: dict[int, int] = {}  # per partition: every record below it is written

    async def acquire(self, partitions: set[int]) -> None:
        self._owned |= partitions

    def release(self, partitions: set[int]) -> None:
        self._owned -= partitions
        for p in partitions:
            self._taken.pop(p, None)
            self._done.pop(p, None)

    def room(self) -> None:
        return None  # a cycle writes all it took

    async def wait_for_room(self, timeout: float) -> None:
        return None

    def take(self, records: Records) -> None:
        for p, batch in records.items():
            self._taken.setdefault(p, []).extend(batch)

    def committable(self, positions: dict[int, int]) -> dict[int, int]:
        return dict(self._done)

    def committed(self, offsets: dict[int, int]) -> None:
        return None

    async def tick(self) -> None:
        """Write what was taken; its offsets are done once the lines and letters are out."""
        taken, self._taken = self._taken, {}
        if not taken:
            return
        task_ids = [task_id for batch in taken.values() for record in batch
                    if (task_id := await self._write(record)) is not None]
        await self._writer.flush()
        await self._producer.flush()  # dead letters are delivered before their offsets are committed
        for p, batch in taken.items():
            if p in self._owned:  # a partition lost meanwhile is re-read by its new owner
                self._done[p] = batch[-1].offset + 1
        if task_ids:
            shown = sorted(set(task_ids))
            log.info("dumped %d episode(s) of task(s) %s%s", len(task_ids), ", ".join(shown[:8]),
                     "..." if len(shown) > 8 else "")

    async def _write(self, record: ConsumerRecord) -> str | None:
        """Dump one record (or dead-letter it); returns the dumped episode's task id."""
        MESSAGES_IN.labels(TIER, "scored").inc()
        try:
            message = decode_scored(record.value)
        except WireDecodeError as exc:
            DEAD_LETTERS.labels(TIER, "undecodable").inc()
            await send_dead_letter(self._producer, self._names.dead_letter, dead_letter_for(record, TIER, exc.reason, exc))
            MESSAGES_OUT.labels(TIER, "dead-letter").inc()
            return None
        if not isinstance(message, ScoredEpisode):
            return None  # rejections and failures have no trajectory to dump
        await self._writer.write(message)
        EPISODES.labels(TIER, "dumped").inc()
        return message.episode.task_id


async def run(config: RollstreamConfig, stop: asyncio.Event) -> None:
    """Dump every scored episode until ``stop`` is set; commits after each written cycle."""
    check_single_writer(config)
    names = TopicNames.of(config)
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
        producer = make_producer(config.kafka, TIER)
        await start_client(producer, config.kafka, "the dump tier's dead-letter producer")
        stack.push_async_callback(stop_client, producer, "the producer of the dump tier")
        stack.push_async_callback(writer.close)
        consumer = make_consumer(config.kafka, TIER, group_id=names.group_id(TIER), read_committed=True)
        delivery = AtLeastOnce(DumpIntake(writer, producer, names), commit_interval=COMMIT_EVERY_CYCLE,
                               retry=KAFKA_RETRY, name="the dump tier")
        loop = PartitionLoop(consumer=consumer, topic=names.scored, delivery=delivery,
                             poll_timeout_ms=POLL_TIMEOUT_MS, name="the dump tier")
        loop.subscribe()
        await start_client(consumer, config.kafka, "the dump tier's consumer")
        stack.push_async_callback(stop_client, consumer, "the consumer of the dump tier")
        log.info("dump tier consuming %s as group %s, writing to %s", names.scored, names.group_id(TIER),
                 writer.root / writer.experiment / writer.trial)
        mark_ready()
        await loop.run(stop)  # its last cycle commits what is written

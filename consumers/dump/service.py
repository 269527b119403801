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

import logging
import os
import socket

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from rollstream.config import ConfigError, RollstreamConfig
from rollstream.dump.lines import DumpWriter
from rollstream.kafka.dead_letter import dead_letter_for, send_dead_letter
from rollstream.kafka.partition_loop import Records
from rollstream.kafka.topics import TopicNames
from rollstream.runtime.metrics import DEAD_LETTERS, EPISODES, MESSAGES_IN, MESSAGES_OUT
from rollstream.state.version_store import VersionStore
from rollstream.tier.context import TierContext
from rollstream.tier.declaration import AT_LEAST_ONCE, Reads, Tier
from rollstream.tier.runtime import entry
from rollstream.wire import ScoredEpisode, WireDecodeError, decode_scored

log = logging.getLogger(__name__)

TIER = "dump"
POLL_TIMEOUT_MS = 500
COMMIT_EVERY_CYCLE = 0.0  # the loop's commit interval: each cycle's written offsets


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


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


def declare(config: RollstreamConfig) -> Tier:
    check_single_writer(config)
    reads = Reads("scored", poll_timeout_ms=POLL_TIMEOUT_MS)
    return Tier(TIER, default_instance_id(), reads, (), AT_LEAST_ONCE, build,
                commit_interval_seconds=COMMIT_EVERY_CYCLE)


async def build(ctx: TierContext) -> DumpIntake:
    """The writer (with ``dump.fields: extended``, reading versions from Redis) and the
    dead-letter producer; the writer's files are flushed and closed last."""
    versions = None
    if ctx.config.dump.fields == "extended":  # trainer version and weight paths live in Redis
        versions = VersionStore(await ctx.redis(), ctx.keys)
    writer = DumpWriter.from_config(ctx.config, versions=versions)
    producer = await ctx.producer()
    ctx.on_close("closing the dump files", writer.close)
    log.info("%s writing to %s", ctx.tier.label, writer.root / writer.experiment / writer.trial)
    return DumpIntake(writer, producer, ctx.names)


run = entry(declare)

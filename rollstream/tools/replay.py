"""Replay one topic of an experiment, bounded and in a deterministic order.

Semantics (the end offsets captured at start, partition order, the sinks, stop and resume
with a resume file so that interrupted runs add up to one uninterrupted run):
docs/DEBUGGING.md, "Replay semantics".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from rollstream.config import RollstreamConfig
from rollstream.dump.lines import DumpWriter, load_tokenizer, tokenizer_path_for
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer, make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.tools.filters import RecordFilter
from rollstream.tools.positions import load_resume, save_resume, start_offsets
from rollstream.tools.render import TensorMode
from rollstream.kafka.admin import topic_partitions
from rollstream.kafka.scan import read_bounded
from rollstream.tools.roles import decode_record, topic_for
from rollstream.tools.sinks import DumpSink, JsonlSink, Sink, TopicSink
from rollstream.wire import WireDecodeError

log = logging.getLogger(__name__)

STALL_SECONDS = 30.0  # no progress below the captured end offset for this long is an error


class ReplayError(RuntimeError):
    """The replay cannot run as asked (missing topic, bad resume file, same source and target)."""


@dataclass
class ReplayOptions:
    """What to replay and where to. No output at all is a dry run that only counts."""

    offsets: dict[int, int] = field(default_factory=dict)  # see positions.parse_offset_specs
    since_ms: int | None = None
    filter: RecordFilter = field(default_factory=RecordFilter)
    to_dump: Path | None = None
    to_jsonl: Path | None = None
    tensors: TensorMode = "full"
    to_experiment: str | None = None
    to_trial: str | None = None  # default: the source trial name
    tokenizer_path: str | None = None  # for --to-dump; default: tokenizer_path_for(config)
    resume_file: Path | None = None
    checkpoint_every: int = 100
    max_records: int | None = None  # stop (resumably) after reading this many records


@dataclass
class ReplayStats:
    topic: str
    start: dict[int, int] = field(default_factory=dict)
    end: dict[int, int] = field(default_factory=dict)
    next: dict[int, int] = field(default_factory=dict)
    read: int = 0
    matched: int = 0
    written: int = 0
    undecodable: int = 0
    completed: bool = False  # False: stopped early (stop event or max_records)

    @property
    def total(self) -> int:
        """Offsets to cover (end - start over partitions; transaction markers included)."""
        return sum(self.end[p] - self.start[p] for p in self.end)


ProgressFn = Callable[[int], None]  # called with the number of offsets just covered


async def replay(
    config: RollstreamConfig,
    role: str,
    options: ReplayOptions,
    *,
    stop: asyncio.Event | None = None,
    on_start: Callable[[ReplayStats], None] | None = None,
    progress: ProgressFn | None = None,
) -> ReplayStats:
    """Replay the ``role`` topic of ``config``'s experiment into the configured sinks."""
    topic = topic_for(TopicNames.of(config), role)
    async with contextlib.AsyncExitStack() as stack:
        consumer = make_consumer(config.kafka, "replay", group_id=None, read_committed=True)
        await consumer.start()
        stack.push_async_callback(consumer.stop)
        stats = await _plan(config, consumer, topic, options)
        sinks = await _open_sinks(
            stack, config, role, options, resuming=bool(stats.next), source_partitions=len(stats.start)
        )
        stats.next = dict(stats.start)
        if on_start is not None:
            on_start(stats)
        log.info("replaying %s: %d offsets in %d partitions", topic, stats.total, len(stats.start))
        await _Runner(config, role, options, sinks, stats, stop, progress).run()
        log.info(
            "replay of %s %s: read %d, matched %d, written %d, undecodable %d",
            topic, "done" if stats.completed else "stopped", stats.read, stats.matched, stats.written, stats.undecodable,
        )
        return stats


async def _plan(config: RollstreamConfig, consumer: AIOKafkaConsumer, topic: str, options: ReplayOptions) -> ReplayStats:
    partitions = await topic_partitions(config.kafka, topic)
    if partitions is None:
        raise ReplayError(f"topic {topic} does not exist (check experiment.experiment_name / trial_name)")
    tps = [TopicPartition(topic, p) for p in partitions]
    begin = {tp.partition: o for tp, o in (await consumer.beginning_offsets(tps)).items()}
    end = {tp.partition: o for tp, o in (await consumer.end_offsets(tps)).items()}
    since = None
    if options.since_ms is not None:
        found = await consumer.offsets_for_times({tp: options.since_ms for tp in tps})
        since = {tp.partition: (None if hit is None else hit.offset) for tp, hit in found.items()}
    resume = None
    if options.resume_file is not None:
        try:
            resume = load_resume(options.resume_file, topic)
        except ValueError as exc:
            raise ReplayError(str(exc)) from None
    starts = start_offsets(partitions, begin, end, offsets=options.offsets, since=since, resume=resume)
    # ``next`` non-empty tells the caller this run continues an earlier one.
    return ReplayStats(topic=topic, start=starts, end=end, next=dict(resume or {}))


async def _open_sinks(
    stack: contextlib.AsyncExitStack, config: RollstreamConfig, role: str, options: ReplayOptions,
    *, resuming: bool, source_partitions: int,
) -> list[Sink]:
    sinks: list[Sink] = []
    if options.to_jsonl is not None:
        jsonl = JsonlSink(options.to_jsonl, options.tensors, append=resuming)
        stack.push_async_callback(jsonl.close)
        sinks.append(jsonl)
    if options.to_dump is not None:
        path = options.tokenizer_path or tokenizer_path_for(config)
        tokenizer = await asyncio.to_thread(load_tokenizer, path) if path else None
        if tokenizer is None:
            log.warning("no tokenizer configured: dump lines get prompt/completion null")
        exp = config.experiment
        # No Redis: the trainer's version now says nothing about recorded episodes (emitted
        # groups carry theirs), so extended lines get trainer_version (episodes) and weight_path null.
        writer = DumpWriter(options.to_dump, exp.experiment_name, exp.trial_name, tokenizer, fields=config.dump.fields)
        sink = DumpSink(writer)
        stack.push_async_callback(sink.close)
        sinks.append(sink)
    if options.to_experiment is not None:
        trial = options.to_trial or config.experiment.trial_name
        target = TopicNames(options.to_experiment, trial)
        topic = topic_for(target, role)
        if topic == topic_for(TopicNames.of(config), role):
            raise ReplayError("--to-experiment names the source experiment and trial: nothing to copy into")
        await ensure_topics(config.kafka, target)
        producer = make_producer(config.kafka, "replay")
        await producer.start()
        stack.push_async_callback(producer.stop)
        keep_partition = len(await producer.partitions_for(topic)) == source_partitions
        topic_sink = TopicSink(producer, topic, keep_partition=keep_partition)
        stack.push_async_callback(topic_sink.close)
        sinks.append(topic_sink)
    return sinks


class _Runner:
    """Reads the planned offsets partition by partition and feeds the sinks."""

    def __init__(
        self, config: RollstreamConfig, role: str, options: ReplayOptions, sinks: list[Sink],
        stats: ReplayStats, stop: asyncio.Event | None, progress: ProgressFn | None,
    ) -> None:
        self.config, self.role, self.options, self.sinks = config, role, options, sinks
        self.stats, self.stop, self.progress = stats, stop, progress
        self.decode = options.filter.active or any(sink.needs_message for sink in sinks)
        self.since_checkpoint = 0

    def _should_stop(self) -> bool:
        limit = self.options.max_records
        return (self.stop is not None and self.stop.is_set()) or (limit is not None and self.stats.read >= limit)

    async def run(self) -> None:
        for partition in sorted(self.stats.start):
            if not await self._partition(TopicPartition(self.stats.topic, partition)):
                await self._checkpoint()
                return
        self.stats.completed = True
        await self._checkpoint()

    async def _partition(self, tp: TopicPartition) -> bool:
        """Replay one partition up to its end offset; False when told to stop first."""
        p, end = tp.partition, self.stats.end[tp.partition]
        if self.stats.next[p] >= end:
            return True
        chunks = read_bounded(self.config.kafka, tp.topic, "replay", partitions=[p], start={p: self.stats.next[p]},
                              end={p: end}, stall_seconds=STALL_SECONDS)
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    for record in chunk.records:
                        if self._should_stop():
                            return False
                        await self._record(tp, record)
                    self._advance(tp, chunk.position)  # also over markers and aborted records
                    if self._should_stop() and self.stats.next[p] < end:
                        return False
        except TimeoutError as exc:
            raise ReplayError(str(exc)) from None
        return True

    def _advance(self, tp: TopicPartition, next_offset: int) -> None:
        covered = next_offset - self.stats.next[tp.partition]
        if covered > 0:
            self.stats.next[tp.partition] = next_offset
            if self.progress is not None:
                self.progress(covered)

    async def _record(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        self.stats.read += 1
        message, error = self._decode(record)
        if not self.options.filter.active or (message is not None and self.options.filter.accepts(message)):
            self.stats.matched += 1
            wrote = False
            for sink in self.sinks:
                wrote = await sink.write(record, message, error) or wrote
            self.stats.written += int(wrote)
        self._advance(tp, record.offset + 1)
        self.since_checkpoint += 1
        if self.since_checkpoint >= self.options.checkpoint_every:
            await self._checkpoint()

    def _decode(self, record: ConsumerRecord) -> tuple[Any, str | None]:
        if not self.decode:
            return None, None
        try:
            return decode_record(self.role, record.value), None
        except WireDecodeError as exc:
            self.stats.undecodable += 1
            return None, exc.reason

    async def _checkpoint(self) -> None:
        for sink in self.sinks:
            await sink.flush()
        self.since_checkpoint = 0
        if self.options.resume_file is not None:
            await asyncio.to_thread(save_resume, self.options.resume_file, self.stats.topic, dict(self.stats.next))

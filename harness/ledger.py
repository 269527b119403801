"""The accounting invariant, read from the topics themselves (read_committed).

``admitted`` is the set of task ids on ``prompts``; every one of them must end as exactly one
group in a ``batch`` record or exactly one ``dropped`` record on ``batches``, with no row of an
emitted batch repeated by ``(task_id, sample_idx)``. :class:`BatchesWatcher` follows
``batches`` while a run goes on (progress, and the trainer's version steps; any topic with
:class:`TopicFollower`); :func:`read_topic` reads a whole topic to its last stable offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from harness.waits import stop_task
from rollstream.config import KafkaConfig
from rollstream.kafka.admin import topic_partitions
from rollstream.kafka.clients import make_admin, make_consumer, stop_client
from rollstream.kafka.scan import read_bounded
from rollstream.runtime.deadline import within
from rollstream.wire import EmittedGroup, GroupDropped, decode_group


log = logging.getLogger(__name__)


@dataclass
class Ledger:
    """What ``batches`` says happened to each task."""

    emitted: Counter[str] = field(default_factory=Counter)  # task -> groups emitted
    dropped: Counter[str] = field(default_factory=Counter)  # task -> drop records
    drop_reasons: Counter[str] = field(default_factory=Counter)
    rows: Counter[tuple[str, int]] = field(default_factory=Counter)  # (task, sample_idx) -> rows
    batches: int = 0
    undecodable: int = 0

    def add(self, message: EmittedGroup | GroupDropped) -> None:
        if isinstance(message, GroupDropped):
            self.dropped[message.task_id] += 1
            self.drop_reasons[message.reason] += 1
            return
        self.batches += 1
        self.emitted[message.task_id] += 1
        for idx in message.sample_idx:
            self.rows[(message.task_id, idx)] += 1

    @property
    def accounted(self) -> set[str]:
        return set(self.emitted) | set(self.dropped)

    def duplicate_tasks(self) -> list[str]:
        """Task ids that ended more than once (emitted twice, dropped twice, or both)."""
        total = self.emitted + self.dropped
        return sorted(task for task, n in total.items() if n > 1)

    def duplicate_rows(self) -> list[tuple[str, int]]:
        return sorted(key for key, n in self.rows.items() if n > 1)

    def check(self, admitted: set[str]) -> list[str]:
        """Every way the invariant is broken, as readable lines (empty: it holds exactly)."""
        problems = []
        lost = admitted - self.accounted
        extra = self.accounted - admitted
        if lost:
            problems.append(f"{len(lost)} admitted tasks never ended: {sorted(lost)[:10]}")
        if extra:
            problems.append(f"{len(extra)} ended tasks were never admitted: {sorted(extra)[:10]}")
        if self.duplicate_tasks():
            problems.append(f"tasks ended more than once: {self.duplicate_tasks()[:10]}")
        if self.duplicate_rows():
            problems.append(f"rows emitted more than once: {self.duplicate_rows()[:10]}")
        if self.undecodable:
            problems.append(f"{self.undecodable} undecodable records on batches")
        return problems


def _consumer(config: KafkaConfig, topic: str) -> AIOKafkaConsumer:
    return make_consumer(config, f"fault-reader-{topic}", group_id=None, read_committed=True)


async def read_topic(config: KafkaConfig, topic: str, decode: Callable[[bytes], Any],
                     timeout: float = 60.0, settled: bool = False) -> list[Any]:
    """Every committed message of ``topic``, from the beginning to its end (see :func:`read_records`)."""
    return [decode(r.value) for r in await read_records(config, topic, timeout=timeout, settled=settled)]


async def read_records(config: KafkaConfig, topic: str, start: dict[int, int] | None = None,
                       timeout: float = 60.0, settled: bool = False) -> list[ConsumerRecord]:
    """The committed records of ``topic`` from ``start`` (partition -> offset; the beginning of
    a partition it does not name) to its end: the product's bounded read
    (``rollstream.kafka.scan``), failing when a partition makes no progress for ``timeout`` s.

    The end is the last stable offset when the read starts, or with ``settled`` the high
    watermark once no transaction is pending: a read right after a transactional writer
    committed must be settled, because the broker writes the commit markers after the commit
    returns, and until they land the last stable offset is before the committed records."""
    records: list[ConsumerRecord] = []
    chunks = read_bounded(config, topic, f"fault-reader-{topic}", start=start, settled=settled, stall_seconds=timeout)
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            records += chunk.records
    return records


async def unconsumed(config: KafkaConfig, topic: str, group_id: str, timeout: float = 60.0) -> list[ConsumerRecord]:
    """The committed records of ``topic`` after the offsets ``group_id`` committed (every record
    of a partition it committed nothing for): what that consumer group has yet to consume."""
    admin = make_admin(config, "fault-lag")
    try:
        await within(admin.start(), timeout, "starting the admin client reading committed offsets")
        committed = await within(admin.list_consumer_group_offsets(group_id), timeout,
                                 f"reading the committed offsets of {group_id}")
    finally:
        await stop_client(admin, "the admin client reading committed offsets")
    start = {tp.partition: meta.offset for tp, meta in committed.items()
             if tp.topic == topic and meta is not None and meta.offset >= 0}
    return await read_records(config, topic, start, timeout)


class TopicFollower:
    """Follows ``topic`` (read_committed, from the beginning) and hands every record to
    ``handle`` until closed; ``changed`` is set after each fetch that brought records.

    Every wait ends: the start waits at most ``START_SECONDS`` for the topic's partitions (a
    node of a cluster may not know a topic created a moment ago) and for the consumer, and the
    close at most ``STOP_SECONDS`` for the consumer's stop; either names what it waited for.
    The partitions are ASSIGNED, not subscribed: a metadata answer of a node that has not
    applied the topic yet cannot take the assignment away (the 3-node cluster test once hung
    in a subscribed follower's stop after exactly that)."""

    START_SECONDS = 60.0
    STOP_SECONDS = 30.0

    def __init__(self, config: KafkaConfig, topic: str, handle: Callable[[ConsumerRecord], None]) -> None:
        self._config, self._topic, self._handle = config, topic, handle
        self._consumer = _consumer(config, topic)
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()

    async def __aenter__(self) -> TopicFollower:
        try:
            await within(self._start(), self.START_SECONDS, f"starting the follower of {self._topic}")
        except BaseException:
            await stop_client(self._consumer, f"the follower of {self._topic}", self.STOP_SECONDS)
            raise
        self._task = asyncio.create_task(self._follow(), name=f"follow-{self._topic}")
        return self

    async def _start(self) -> None:
        while not (partitions := await topic_partitions(self._config, self._topic)):
            await asyncio.sleep(0.5)  # just created: the node asked may not know the topic yet
        await self._consumer.start()
        tps = [TopicPartition(self._topic, p) for p in partitions]
        self._consumer.assign(tps)
        # explicit offsets, not seek_to_beginning: its reset waits on the fetcher with no
        # bound, and on the 3-node cluster it once never returned
        begins = await self._consumer.beginning_offsets(tps)
        for tp in tps:
            self._consumer.seek(tp, begins[tp])

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            await stop_task(self._task, f"the follower of {self._topic}")
        await stop_client(self._consumer, f"the follower of {self._topic}", self.STOP_SECONDS)

    async def _follow(self) -> None:
        while True:
            # aiokafka reconnects by itself across a broker restart; getmany just returns nothing
            fetched = await self._consumer.getmany(timeout_ms=500)
            for records in fetched.values():
                for record in records:
                    self._handle(record)
                self.changed.set()

    def check_alive(self) -> None:
        if self._task is not None and self._task.done():
            self._task.result()
            raise RuntimeError(f"the follower of {self._topic} stopped")


class BatchesWatcher(TopicFollower):
    """Follows ``batches`` into a :class:`Ledger`; ``on_message`` (optional) sees every decoded
    record too, with its Kafka record."""

    def __init__(self, config: KafkaConfig, topic: str,
                 on_message: Callable[[ConsumerRecord, EmittedGroup | GroupDropped], None] | None = None) -> None:
        super().__init__(config, topic, self._add)
        self.ledger = Ledger()
        self._on_message = on_message

    def _add(self, record: ConsumerRecord) -> None:
        try:
            message = decode_group(record.value)
        except ValueError:
            self.ledger.undecodable += 1
            return
        self.ledger.add(message)
        if self._on_message is not None:
            self._on_message(record, message)

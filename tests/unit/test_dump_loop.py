"""The dump tier on the shared partition loop (a fake consumer, writer and producer): each
cycle's lines are flushed and its dead letters delivered before the cycle's offsets are
committed; a partition that moves away commits what was written of it first, and records
fetched before it moved are left to its new owner; a failed commit is tried again at the next
cycle without new records."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy
from aiokafka.errors import CommitFailedError
from aiokafka.structs import ConsumerRecord, TopicPartition

from rollstream.consumers.dump.intake import DumpIntake
from rollstream.consumers.dump.service import COMMIT_EVERY_CYCLE
from rollstream.kafka.partition_loop import AtLeastOnce, PartitionLoop
from rollstream.kafka.topics import TopicNames
from rollstream.retry import KAFKA_RETRY
from rollstream.wire import Episode, ScoredEpisode, decode_dead_letter
from rollstream.wire.codec import encode
from rollstream.wire.tensor_codec import encode_arrays

NAMES = TopicNames("exp", "trial")
TOPIC = NAMES.scored


def scored(task_id: str) -> bytes:
    trajectory = encode_arrays({"input_ids": numpy.arange(3, dtype=numpy.int32)[None],
                                "attention_mask": numpy.ones((1, 3), dtype=bool)})
    episode = Episode(task_id=task_id, sample_idx=0, group_size=1, trajectory=trajectory, is_eval=False,
                      head_version=0, tail_version=0)
    return encode(ScoredEpisode(episode=episode, reward=1.0))


def record(partition: int, offset: int, value: bytes) -> ConsumerRecord:
    return ConsumerRecord(TOPIC, partition, offset, 0, 0, b"k", value, None, 1, len(value), ())


class FakeConsumer:
    """Hands out queued fetches; commits are recorded (the first ``refuse`` ones fail)."""

    def __init__(self, refuse: int = 0) -> None:
        self.fetches: list[dict[TopicPartition, list[ConsumerRecord]]] = []
        self.commits: list[dict[TopicPartition, int]] = []
        self.refuse = refuse
        self.assigned: set[TopicPartition] = set()
        self._paused: set[TopicPartition] = set()
        self._positions: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}

    async def getmany(self, *tps: TopicPartition, timeout_ms: int = 0, max_records: int | None = None) -> Any:
        await asyncio.sleep(0)
        return self.fetches.pop(0) if self.fetches else {}

    async def commit(self, offsets: dict[TopicPartition, int | tuple[int, str]]) -> None:
        """As aiokafka's: an offset, or ``(offset, metadata)``; the offsets are recorded."""
        if self.refuse:
            self.refuse -= 1
            raise CommitFailedError("rebalanced under the commit")
        plain = {tp: o[0] if isinstance(o, tuple) else o for tp, o in offsets.items()}
        self.commits.append(plain)
        self._committed.update(plain)

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def pause(self, *tps: TopicPartition) -> None:
        self._paused |= set(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self._paused -= set(tps)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, 0)

    async def committed(self, tp: TopicPartition) -> int | None:
        return self._committed.get(tp)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._positions[tp] = offset

    async def position(self, tp: TopicPartition) -> int:
        return self._positions.get(tp, 0)


class FakeWriter:
    def __init__(self) -> None:
        self.buffered: list[str] = []
        self.flushed: list[str] = []

    async def write(self, message: ScoredEpisode) -> int:
        self.buffered.append(message.episode.task_id)
        return 1

    async def flush(self) -> None:
        self.flushed += self.buffered
        self.buffered = []


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.delivered = 0

    async def send(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self.sent.append((topic, value))

    async def flush(self) -> None:
        self.delivered = len(self.sent)


def dump_loop(consumer: FakeConsumer) -> tuple[PartitionLoop, FakeWriter, FakeProducer]:
    writer, producer = FakeWriter(), FakeProducer()
    intake = DumpIntake(writer, producer, NAMES)  # type: ignore[arg-type]
    delivery = AtLeastOnce(intake, commit_interval=COMMIT_EVERY_CYCLE, retry=KAFKA_RETRY, name="dump")
    loop = PartitionLoop(consumer=consumer, topic=TOPIC, delivery=delivery, poll_timeout_ms=10)  # type: ignore[arg-type]
    return loop, writer, producer


async def assign(loop: PartitionLoop, consumer: FakeConsumer, *partitions: int) -> None:
    tps = {TopicPartition(TOPIC, p) for p in partitions}
    consumer.assigned |= tps
    await loop.ownership.on_partitions_assigned(tps)


async def test_a_cycle_commits_after_its_lines_are_flushed_and_its_letters_delivered() -> None:
    consumer = FakeConsumer()
    loop, writer, producer = dump_loop(consumer)
    await assign(loop, consumer, 0, 1)
    consumer.fetches.append({TopicPartition(TOPIC, 0): [record(0, 0, scored("a")), record(0, 1, b"\x00bad")],
                             TopicPartition(TOPIC, 1): [record(1, 0, scored("b"))]})
    await loop.poll_once()
    assert sorted(writer.flushed) == ["a", "b"] and not writer.buffered
    assert producer.delivered == 1
    assert decode_dead_letter(producer.sent[0][1]).offset == 1  # the undecodable record, not the tier, fails
    assert consumer.commits == [{TopicPartition(TOPIC, 0): 2, TopicPartition(TOPIC, 1): 1}]
    await loop.poll_once()  # nothing new: nothing committed again
    assert len(consumer.commits) == 1


async def test_a_failed_commit_is_tried_again_without_new_records() -> None:
    consumer = FakeConsumer(refuse=1)
    loop, writer, _ = dump_loop(consumer)
    await assign(loop, consumer, 0)
    consumer.fetches.append({TopicPartition(TOPIC, 0): [record(0, 0, scored("a"))]})
    await loop.poll_once()
    assert writer.flushed == ["a"] and consumer.commits == []
    await loop.poll_once()
    assert consumer.commits == [{TopicPartition(TOPIC, 0): 1}]


async def test_a_partition_that_moves_away_leaves_what_was_fetched_before_to_its_new_owner() -> None:
    consumer = FakeConsumer()
    loop, writer, _ = dump_loop(consumer)
    await assign(loop, consumer, 0, 1)
    consumer.fetches.append({TopicPartition(TOPIC, 0): [record(0, 0, scored("a"))]})
    await loop.poll_once()
    revoked = {TopicPartition(TOPIC, 1)}
    fetched_before = {TopicPartition(TOPIC, 1): [record(1, 0, scored("late"))]}
    consumer.fetches.append(fetched_before)
    original = consumer.getmany

    async def getmany_then_rebalance(*tps: TopicPartition, **kw: Any) -> Any:
        fetched = await original(*tps, **kw)
        await loop.ownership.on_partitions_revoked(revoked)  # the group moved it during the fetch
        consumer.assigned -= revoked
        return fetched

    consumer.getmany = getmany_then_rebalance  # type: ignore[method-assign]
    await loop.poll_once()
    assert writer.flushed == ["a"]  # "late" is its new owner's to write
    assert all(TopicPartition(TOPIC, 1) not in offsets for offsets in consumer.commits)

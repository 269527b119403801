"""The trainer API on one process against the real broker: long steps, the ledger across restarts,
replays, the DataLoader adapter.

The long-step test runs a 15 s step with ``max.poll.interval.ms`` at 5 s: the trainer's consumer
keeps its membership (no rebalance, nothing delivered again), while a plain consumer with the
same settings that does not poll during its step is put out of the group and handed its records
again (the control that shows the setting is live).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from aiokafka import ConsumerRebalanceListener
from aiokafka.structs import TopicPartition
from torch.utils.data import DataLoader

from harness.configs import make_config
from harness.episodes import scored
from rollstream.config import RollstreamConfig
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.consumers.grouping.groups import CompleteGroup
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer, make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.tools.replay import ReplayOptions, replay
from rollstream.trainer import (
    StepDataset,
    StepStream,
    DumpReplay,
    LedgerReplay,
    RangeReplay,
    StepLedger,
    TrainerSteps,
    TrainingStep,
)
from rollstream.trainer.kafka_source import KafkaStepSource
from rollstream.trainer.replay import ReplayError
from rollstream.wire import GroupDropped, encode


pytestmark = pytest.mark.broker

STEP_SECONDS = 15.0


def group(task: str, gen_len: int = 2) -> CompleteGroup:
    eps = tuple(scored(task, i, 2, reward=float(i), gen_len=gen_len + i, version=1) for i in range(2))
    return CompleteGroup(task, 2, False, eps, 0, 0, 0, 0, 0.0)


def trainer_config(kafka: str, redis_url: str, name: str, tmp: Path, **trainer: Any) -> RollstreamConfig:
    step = trainer.pop("groups_per_step", 2)
    settings = {"group_id": f"{name}-trainer", "ledger_path": str(tmp / "ledger.jsonl"), "poll_timeout_ms": 200, **trainer}
    return make_config(kafka, redis_url, name, {"staleness": {"groups_per_step": step}, "trainer": settings})


async def write(config: RollstreamConfig, tasks: list[str], partition: int = 0) -> None:
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    producer = make_producer(config.kafka, "test-batches")
    await producer.start()
    try:
        for task in tasks:
            value = encode(build_emitted_group(group(task, gen_len=1 + len(task) % 3), trainer_version=1))
            await producer.send_and_wait(names.batches, value, key=task.encode(), partition=partition)
    finally:
        await producer.stop()


async def committed(config: RollstreamConfig, partitions: int = 2) -> dict[int, int | None]:
    names = TopicNames.of(config)
    consumer = make_consumer(config.kafka, "test-offsets", group_id=config.trainer.group_id)
    await consumer.start()
    try:
        return {p: await consumer.committed(TopicPartition(names.batches, p)) for p in range(partitions)}
    finally:
        await consumer.stop()


def rows_of(batch: TrainingStep, task: str) -> dict[str, list[Any]]:
    """The attended values of ``task``'s rows (padding left out: batches pad differently)."""
    index = batch.task_ids.index(task)
    rows = [r for r, t in enumerate(batch.row_task) if t == index]
    mask = batch.tensors["attention_mask"]
    return {k: [v[r][mask[r]].tolist() if v.dim() > 1 else v[r].item() for r in rows]
            for k, v in batch.tensors.items() if k != "attention_mask"}


# -- a step longer than max.poll.interval.ms --

def train_slowly(config: RollstreamConfig) -> dict[str, Any]:
    """The synchronous loop: a 15 s first step, then one more step."""
    with TrainerSteps(config, wait_seconds=1.0) as batches:
        it = iter(batches)
        first = next(it)
        time.sleep(STEP_SECONDS)  # the trainer's thread is busy; the consumer's thread keeps polling
        batches.commit(first)
        second = next(it)
        batches.commit(second)
        source = batches.source
        assert isinstance(source, KafkaStepSource)
        return {"steps": [first.task_ids, second.task_ids], "duplicates": batches.duplicates_skipped,
                "assignments": source.assignments, "revocations": source.revocations}


class Assignments(ConsumerRebalanceListener):
    def __init__(self) -> None:
        self.count = 0

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        pass

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.count += 1


async def stalled_consumer(config: RollstreamConfig, group_id: str) -> tuple[list[int], int]:
    """The control: a plain consumer with the same settings that does not poll while its step
    runs. Returns the offsets it was handed (before and after the step) and its assignments."""
    names = TopicNames.of(config)
    tc = config.trainer
    consumer = make_consumer(config.kafka, "control", group_id=group_id, max_poll_interval_ms=tc.max_poll_interval_ms,
                             session_timeout_ms=tc.session_timeout_ms, heartbeat_interval_ms=tc.heartbeat_interval_ms)
    listener = Assignments()
    consumer.subscribe([names.batches], listener=listener)
    await consumer.start()
    try:
        offsets: list[int] = []
        for stall in (STEP_SECONDS, 0.0):
            fetched: dict[Any, Any] = {}
            while not fetched:
                fetched = await consumer.getmany(timeout_ms=500, max_records=2)
            offsets += [r.offset for records in fetched.values() for r in records]
            await asyncio.sleep(stall)  # the step, without a poll
        return offsets, listener.count
    finally:
        await consumer.stop()


async def test_a_step_longer_than_max_poll_interval_keeps_the_membership(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    config = trainer_config(kafka_bootstrap, redis_url, unique_name, tmp_path, max_poll_interval_ms=5000,
                            session_timeout_ms=6000, heartbeat_interval_ms=1000)
    await write(config, ["a", "b", "c", "d"])
    control = asyncio.create_task(stalled_consumer(config, f"{unique_name}-control"))
    result = await asyncio.to_thread(train_slowly, config)
    control_offsets, control_assignments = await control
    # the control shows what the setting does to a consumer that stops polling: it left the
    # group, joined again and was handed the same records once more
    assert control_assignments == 2 and control_offsets == [0, 1, 0, 1], (control_offsets, control_assignments)
    assert result["steps"] == [["a", "b"], ["c", "d"]]  # nothing delivered again
    assert (result["assignments"], result["revocations"], result["duplicates"]) == (1, 0, 0)  # no rebalance
    assert (await committed(config))[0] == 4


# -- the ledger across restarts --

async def test_the_ledger_resumes_after_the_last_committed_step_and_drops_an_uncommitted_one(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    config = trainer_config(kafka_bootstrap, redis_url, unique_name, tmp_path)
    await write(config, ["a", "b", "c", "d", "e", "f"])
    async with StepStream(config) as stream:
        first = await stream.next_step(timeout=60)
        assert first is not None and first.step == 1 and first.task_ids == ["a", "b"]
        await stream.commit(first)
        second = await stream.next_step(timeout=60)
        assert second is not None and second.step == 2
        # the trainer dies between writing step 2 to the ledger and committing its offsets
        await stream.source.record(stream.book.due(2))  # type: ignore[attr-defined]
    assert [e.step for e in StepLedger(tmp_path / "ledger.jsonl").read()] == [1, 2]
    async with StepStream(config) as again:
        assert again.last_committed_step == 1  # step 2 was dropped from the ledger: never committed
        redo = await again.next_step(timeout=60)
        assert redo is not None and (redo.step, redo.task_ids) == (2, ["c", "d"])  # the same groups, once more
        await again.commit(redo)
    entries = StepLedger(tmp_path / "ledger.jsonl").read()
    assert [(e.step, e.task_ids, e.offsets) for e in entries] == [(1, ["a", "b"], {0: 2}), (2, ["c", "d"], {0: 4})]
    assert (await committed(config))[0] == 4


async def test_groups_in_the_ledger_are_never_handed_out_again(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    """The second line of defence across a restart: a group trained in a committed step that
    shows up again on ``batches`` (a duplicate the pipeline should never write) is skipped."""
    config = trainer_config(kafka_bootstrap, redis_url, unique_name, tmp_path, groups_per_step=1)
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    producer = make_producer(config.kafka, "test-batches")
    await producer.start()
    await producer.send_and_wait(names.batches, encode(build_emitted_group(group("a"), 1)), partition=0)
    async with StepStream(config) as stream:
        first = await stream.next_step(timeout=60)
        assert first is not None and first.task_ids == ["a"]
        await stream.commit(first)
    for task in ("a", "b"):  # "a" again after its step was committed, then a new group
        await producer.send_and_wait(names.batches, encode(build_emitted_group(group(task), 1)), partition=0)
    await producer.stop()
    async with StepStream(config) as again:
        assert again.last_committed_step == 1
        batch = await again.next_step(timeout=60)
        assert batch is not None and batch.task_ids == ["b"] and again.duplicates_skipped == 1


# -- replay into a step --

async def test_a_range_replay_of_a_trial_without_a_batches_topic_says_so(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    config = trainer_config(kafka_bootstrap, redis_url, unique_name, tmp_path)  # nothing written: no topic
    with pytest.raises(ReplayError, match=f"topic {TopicNames.of(config).batches} does not exist"):
        await RangeReplay(config).start()


async def test_replays_hand_out_recorded_steps_exactly_and_commit_nothing(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    config = trainer_config(kafka_bootstrap, redis_url, unique_name, tmp_path)
    await write(config, ["a", "b", "c"], partition=0)
    await write(config, ["x", "y"], partition=1)
    names = TopicNames.of(config)
    producer = make_producer(config.kafka, "test-batches")
    await producer.start()
    await producer.send_and_wait(names.batches, encode(GroupDropped(task_id="z", reason="timeout")), partition=1)
    await producer.stop()
    trained: dict[int, TrainingStep] = {}
    async with StepStream(config) as stream:
        for _ in range(2):
            batch = await stream.next_step(timeout=60)
            assert batch is not None
            trained[batch.step] = batch
            await stream.commit(batch)
    before = await committed(config)

    async with StepStream(config, source=LedgerReplay(config, [2, 1])) as replayed:
        again = [b async for b in replayed]
    assert [b.step for b in again] == [2, 1]
    for batch in again:  # bit for bit the step that was trained
        original = trained[batch.step]
        assert batch.task_ids == original.task_ids
        assert all(torch.equal(batch.tensors[k], v) for k, v in original.tensors.items())

    async with StepStream(config, source=RangeReplay(config, start={0: 1})) as ranged:
        steps = [(b.step, b.task_ids) async for b in ranged]
    assert steps == [(1, ["b", "c"]), (2, ["x", "y"])]  # partition 0 from offset 1, then partition 1
    assert ranged.drops_by_reason == {"timeout": 1}

    dump = tmp_path / "batches.jsonl"
    await replay(config, "batches", ReplayOptions(to_jsonl=dump))
    async with StepStream(config, source=DumpReplay(config, dump)) as dumped:
        from_dump = [b async for b in dumped]
    assert [b.task_ids for b in from_dump] == [["a", "b"], ["c", "x"], ["y"]]  # the rest: a last smaller step
    trained_tasks = [t for b in trained.values() for t in b.task_ids]
    assert len(trained_tasks) == 4
    for task in trained_tasks:  # the dump's tensors are the topic's (whichever steps read them)
        dumped_step = next(b for b in from_dump if task in b.task_ids)
        trained_step = next(b for b in trained.values() if task in b.task_ids)
        assert rows_of(dumped_step, task) == rows_of(trained_step, task)
    assert await committed(config) == before  # no replay committed anything
    assert len(StepLedger(tmp_path / "ledger.jsonl").read()) == 2


# -- the DataLoader adapter --

def load_steps(config: RollstreamConfig) -> list[list[str]]:
    with TrainerSteps(config, wait_seconds=0.5) as batches:
        loader = DataLoader(StepDataset(batches, transform=lambda b: (b.step, b.task_ids)), batch_size=None)
        seen = []
        for step, tasks in loader:
            seen.append(tasks)
            if step == 2:
                batches.stop()  # the loop ends after this step, which is committed too
        return seen


async def test_a_dataloader_loop_commits_each_step_when_it_asks_for_the_next(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    config = trainer_config(kafka_bootstrap, redis_url, unique_name, tmp_path)
    await write(config, ["a", "b", "c", "d", "e", "f"])
    assert await asyncio.to_thread(load_steps, config) == [["a", "b"], ["c", "d"]]
    assert (await committed(config))[0] == 4
    assert [e.step for e in StepLedger(tmp_path / "ledger.jsonl").read()] == [1, 2]

"""emitted_group_rows / assemble / StepAccumulator: a group per record, steps across records, counts, commit offsets."""

from __future__ import annotations

import asyncio

import pytest
import torch
from aiokafka.structs import ConsumerRecord, TopicPartition

from harness.episodes import scored
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.consumers.grouping.groups import CompleteGroup
from rollstream.trainer import StepAccumulator, assemble, emitted_group_rows
from rollstream.trainer.kafka_source import StepIntake
from rollstream.wire import GroupDropped, encode


TOPIC = "rs.x.t0.batches"


def group(task: str, gen_lens: list[int], version: int = 1, is_eval: bool = False) -> CompleteGroup:
    eps = tuple(scored(task, i, len(gen_lens), reward=float(i), gen_len=n, version=version, is_eval=is_eval) for i, n in enumerate(gen_lens))
    return CompleteGroup(task, len(gen_lens), is_eval, eps, 0, 0, 0, 0, 0.0)


def record(value: bytes | None, offset: int, partition: int = 0) -> ConsumerRecord:
    return ConsumerRecord(TOPIC, partition, offset, 0, 0, b"k", value, None, 1, len(value or b""), ())


def test_emitted_group_rows_recovers_the_groups_rows() -> None:
    a = emitted_group_rows(build_emitted_group(group("a", [1, 4, 2]), trainer_version=3))
    assert (a.task_id, a.group_size, a.sample_idx, a.trainer_version) == ("a", 3, [0, 1, 2], 3)
    assert a.tensors["input_ids"].shape == (3, 6) and a.tensors["rewards"].tolist() == [0.0, 1.0, 2.0]


def test_assemble_pads_across_records_and_tracks_versions() -> None:
    g1 = emitted_group_rows(build_emitted_group(group("a", [1, 1], version=2), trainer_version=5))
    g2 = emitted_group_rows(build_emitted_group(group("b", [4], version=4), trainer_version=6))
    step = assemble([g1, g2], pad_value=0.0)
    t = step.tensors
    assert t["input_ids"].shape == (3, 6) and t["versions"][0].tolist() == [-1, -1, 2, -1, -1, -1]
    assert t["attention_mask"][0].tolist() == [True, True, True, False, False, False]
    assert step.row_task == [0, 0, 1] and step.task_ids == ["a", "b"] and step.group_sizes == [2, 1]
    assert step.trainer_versions == [5, 6]
    assert (step.head_version, step.tail_version, step.max_staleness) == (2, 4, 3)
    t["input_ids"][0, 0] = 99  # fresh, writable memory
    single = assemble([g2])
    single.tensors["rewards"].add_(1)
    assert not single.is_eval and single.num_groups == 1


def test_accumulator_counts_and_offsets() -> None:
    acc = StepAccumulator(groups_per_step=2)
    acc.take(record(encode(build_emitted_group(group("a", [1]), 0)), 0))
    acc.take(record(encode(GroupDropped(task_id="d", reason="timeout")), 1))
    acc.take(record(b"\x00garbage", 2))
    acc.take(record(encode(build_emitted_group(group("e", [1], is_eval=True), 0)), 3))
    assert not acc.ready()
    acc.take(record(encode(build_emitted_group(group("b", [1]), 0)), 4))
    acc.take(record(encode(build_emitted_group(group("c", [1]), 0)), 5))
    assert acc.ready()
    first = acc.hand_out()
    assert first.task_ids == ["a", "b"]
    assert first.offsets == {TopicPartition(TOPIC, 0): 5}  # record 5 (group "c") waits for the next step
    assert (acc.drops_by_reason["timeout"], acc.undecodable, acc.eval_skipped) == (1, 1, 1)
    acc.take(record(encode(build_emitted_group(group("f", [1]), 0)), 0, partition=1))
    second = acc.hand_out()
    assert second.task_ids == ["c", "f"]
    assert second.offsets == {TopicPartition(TOPIC, 0): 6, TopicPartition(TOPIC, 1): 1}


def test_accumulator_can_include_eval() -> None:
    acc = StepAccumulator(groups_per_step=1, include_eval=True)
    acc.take(record(encode(build_emitted_group(group("e", [1], is_eval=True), 0)), 0))
    batch = acc.hand_out()
    assert batch.is_eval and batch.group_is_eval == [True]


def test_an_inconsistent_group_is_rejected() -> None:
    emitted = build_emitted_group(group("a", [1, 1]), 0)
    emitted.sample_idx = [0]
    with pytest.raises(ValueError, match="group a has 2 rows but 1 sample_idx entries"):
        emitted_group_rows(emitted)
    acc = StepAccumulator(groups_per_step=1)
    acc.take(record(encode(emitted), 0))
    assert acc.undecodable == 1 and not acc.ready()
    assert torch.is_tensor(emitted_group_rows(build_emitted_group(group("a", [1]), 0)).tensors["rewards"])


def test_a_group_handed_out_before_is_skipped_and_counted_not_trained_twice() -> None:
    """Re-delivered records (an ack refused after a rebalance) never train a group twice."""
    acc = StepAccumulator(groups_per_step=2, remember_steps=4)
    first = [record(encode(build_emitted_group(group(t, [1]), trainer_version=1)), i) for i, t in enumerate("ab")]
    for r in first:
        acc.take(r)
    assert acc.hand_out().task_ids == ["a", "b"]
    acc.reset()  # the rebalance: positions go back, the same records come again
    for r in first + [record(encode(build_emitted_group(group(t, [1]), trainer_version=1)), 2 + i) for i, t in enumerate("cd")]:
        acc.take(r)
    assert acc.duplicates_skipped == 2 and acc.ready()
    assert acc.hand_out().task_ids == ["c", "d"]
    acc.take(record(encode(build_emitted_group(group("c", [1]), trainer_version=1)), 4))
    assert acc.duplicates_skipped == 3 and not acc.ready()  # "c" again


def test_the_memory_of_trained_groups_is_bounded() -> None:
    acc = StepAccumulator(groups_per_step=1, remember_steps=2)
    for i, t in enumerate("abc"):
        acc.take(record(encode(build_emitted_group(group(t, [1]), trainer_version=1)), i))
        acc.hand_out()
    assert "a" not in acc.trained and "b" in acc.trained and "c" in acc.trained


def test_a_training_step_has_rejected_and_failed_per_group() -> None:
    groups = [CompleteGroup("a", 3, False, (scored("a", 0, group_size=3),), 1, 0, 0, 2, 0.0, 1),
              CompleteGroup("b", 1, False, (scored("b", 0, group_size=1),), 0, 0, 3, 3, 0.0)]
    step = assemble([emitted_group_rows(build_emitted_group(g, trainer_version=0)) for g in groups])
    assert (step.group_rejected, step.group_failed) == ([1, 0], [1, 0])


async def test_room_made_before_the_loop_waits_is_taken_at_once() -> None:
    """The trainer hands a step out between the loop's ``room()`` check and its wait: the wait
    returns at once (it once waited out the poll timeout, 0.5 s, in the latency tail)."""
    intake = StepIntake(StepAccumulator(groups_per_step=1), limit=1)
    intake.take({0: [record(encode(build_emitted_group(group("a", [2]), trainer_version=0)), 0)]})
    assert intake.room() == 0 and intake.arrived.is_set()
    intake.accumulator.hand_out()
    intake.handed_out()
    async with asyncio.timeout(1.0):
        await intake.wait_for_room(30.0)
    assert intake.room() == 1


def test_a_group_more_than_eta_behind_the_version_a_step_trains_is_dropped_as_stale() -> None:
    acc = StepAccumulator(groups_per_step=2, include_eval=True)
    for offset, (task, head, is_eval) in enumerate([("old", 1, False), ("ok", 2, False), ("eval", 0, True),
                                                    ("new", 3, False)]):
        acc.take(record(encode(build_emitted_group(group(task, [1], version=head, is_eval=is_eval), 3)), offset, offset % 2))
    assert acc.newest_tag == 3
    assert acc.drop_stale(consume_version=3, eta=1) == ["old"]  # 3 - 1 > 1; eval groups are never dropped
    assert acc.drops_by_reason["stale"] == 1 and acc.waiting == 3
    step = acc.next_step()
    assert [g.task_id for g in step.groups] == ["ok", "eval"] and step.stale == ["old"]
    assert step.offsets == {0: 3, 1: 3}  # the dropped group's record is committed with the step
    assert acc.next_step().stale == []  # listed once


def test_a_stale_drop_of_a_lost_partition_belongs_to_no_step() -> None:
    acc = StepAccumulator(groups_per_step=1)
    acc.take(record(encode(build_emitted_group(group("old", [1], version=0), 5)), 0, partition=1))
    acc.take(record(encode(build_emitted_group(group("ok", [1], version=5), 5)), 0, partition=0))
    assert acc.drop_stale(consume_version=5, eta=2) == ["old"]
    acc.forget({1})  # whoever reads partition 1 next drops it (and counts it) again
    assert acc.next_step().stale == []

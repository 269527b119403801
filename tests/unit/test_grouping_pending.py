"""PendingBatches: full batches, overdue partial batches, eval and partitions apart, offsets held, revoke."""

from __future__ import annotations

from rollstream.consumers.grouping import CompleteGroup
from rollstream.consumers.pending import PendingBatches


def group(task: str, partition: int = 0, offset: int = 0, is_eval: bool = False) -> CompleteGroup:
    return CompleteGroup(task, 1, is_eval, (), 0, partition, offset, offset, 0.0)


def test_full_batches_first_then_overdue_partials() -> None:
    pending = PendingBatches(groups_per_batch=2, flush_seconds=1.0)
    for i in range(3):
        pending.add(group(f"t{i}", offset=i), now=0.0)
    ready = pending.take_ready(0, now=0.5)
    assert [[g.task_id for g in b] for b in ready] == [["t0", "t1"]]
    assert len(pending) == 1 and pending.low_offset(0) == 2
    assert pending.take_ready(0, now=0.9) == []
    assert [[g.task_id for g in b] for b in pending.take_ready(0, now=1.0)] == [["t2"]]
    assert pending.low_offset(0) is None


def test_eval_and_train_never_share_a_batch() -> None:
    pending = PendingBatches(groups_per_batch=2, flush_seconds=10.0)
    pending.add(group("a"), 0.0)
    pending.add(group("e", is_eval=True), 0.0)
    assert pending.take_ready(0, 0.0) == []
    ready = pending.take_ready(0, 0.0, flush_all=True)
    assert sorted([g.task_id for g in b] for b in ready) == [["a"], ["e"]]


def test_revoke_returns_the_partitions_groups() -> None:
    pending = PendingBatches(groups_per_batch=5, flush_seconds=10.0)
    pending.add(group("a", partition=0, offset=3), 0.0)
    pending.add(group("b", partition=1, offset=4), 0.0)
    assert [g.task_id for g in pending.revoke([1])] == ["b"]
    assert pending.low_offset(1) is None and pending.low_offset(0) == 3


def test_groups_of_different_partitions_never_share_a_batch() -> None:
    """Each batch is committed under its input partition's transactional id."""
    pending = PendingBatches(groups_per_batch=2, flush_seconds=10.0)
    pending.add(group("a", partition=0, offset=1), 0.0)
    pending.add(group("b", partition=1, offset=1), 0.0)
    assert pending.take_ready(0, 0.0) == [] and pending.take_ready(1, 0.0) == []
    pending.add(group("c", partition=1, offset=2), 0.0)
    assert [[g.task_id for g in b] for b in pending.take_ready(1, 0.0)] == [["b", "c"]]
    assert [[g.task_id for g in b] for b in pending.take_ready(0, 0.0, flush_all=True)] == [["a"]]

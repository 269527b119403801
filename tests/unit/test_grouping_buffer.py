"""GroupBuffer: completion, duplicates, drops, conflicts, timeouts, watermarks, revoke, memory."""

from __future__ import annotations

import msgspec
import pytest

from harness.episodes import failed, rejected, sample_failed, scored
from rollstream.config import GroupingConfig
from rollstream.consumers.grouping.filters import load_group_filters
from rollstream.consumers.grouping.groups import CompleteGroup, ConflictError, DroppedGroup, GroupBuffer, GroupFilters


def buffer(**filters: object) -> GroupBuffer:
    return GroupBuffer(group_timeout_seconds=10.0, dedupe_window_seconds=100.0, filters=GroupFilters(**filters))


def test_completes_in_any_order_with_episodes_sorted() -> None:
    buf = buffer()
    results = []
    for offset, idx in enumerate([2, 0, 3, 1]):
        results += buf.add(scored("t", idx), partition=0, offset=offset, now=1.0)
    assert len(results) == 1
    group = results[0]
    assert isinstance(group, CompleteGroup)
    assert [e.episode.sample_idx for e in group.episodes] == [0, 1, 2, 3]
    assert (group.rejected, group.min_offset, group.max_offset) == (0, 0, 3)
    assert buf.open_count() == 0


def test_rejected_samples_count_towards_completion() -> None:
    buf = buffer()
    results = [r for i in range(3) for r in buf.add(rejected("t", i), 0, i, 0.0)]
    results += buf.add(scored("t", 3), 0, 3, 0.0)
    (group,) = results
    assert isinstance(group, CompleteGroup)
    assert group.rejected == 3 and len(group.episodes) == 1


def test_duplicate_samples_are_ignored() -> None:
    buf = buffer()
    for offset, idx in enumerate([0, 0, 1, 1, 2]):
        assert buf.add(scored("t", idx), 0, offset, 0.0) == []
    (group,) = buf.add(scored("t", 3), 0, 5, 0.0)
    assert isinstance(group, CompleteGroup) and len(group.episodes) == 4


def test_late_duplicates_after_the_outcome_are_ignored() -> None:
    buf = buffer()
    for i in range(4):
        buf.add(scored("t", i), 0, i, 0.0)
    assert buf.outcomes.known("t")
    for i in range(4):
        assert buf.add(scored("t", i), 0, 10 + i, 1.0) == []
    assert buf.add(failed("t"), 0, 20, 1.0) == []
    assert buf.open_count() == 0
    assert buf.watermark(0) == 21


def test_all_rejected_is_a_drop() -> None:
    buf = buffer()
    results = [r for i in range(4) for r in buf.add(rejected("t", i), 0, i, 0.0)]
    (drop,) = results
    assert isinstance(drop, DroppedGroup) and drop.reason == "all_rejected"
    assert buf.outcomes.get("t").outcome == "dropped"


def test_task_failed_drops_at_once() -> None:
    buf = buffer()
    buf.add(scored("t", 0), 0, 0, 0.0)
    (drop,) = buf.add(failed("t"), 0, 1, 0.0)
    assert isinstance(drop, DroppedGroup) and drop.reason == "task_failed"
    assert (drop.min_offset, drop.max_offset) == (0, 1)
    assert buf.open_count() == 0
    (alone,) = buf.add(failed("u"), 0, 2, 0.0)
    assert alone.reason == "task_failed" and alone.min_offset == 2


def test_group_size_conflict_raises_and_leaves_group_unchanged() -> None:
    buf = buffer()
    buf.add(scored("t", 0, group_size=4), 0, 0, 0.0)
    with pytest.raises(ConflictError, match="group_size 2"):
        buf.add(scored("t", 1, group_size=2), 0, 1, 0.0)
    (group,) = buf.open_groups(0)
    assert list(group.samples) == [0] and group.max_offset == 0
    assert buf.watermark(0) == 0
    results = [r for i in (1, 2, 3) for r in buf.add(scored("t", i), 0, 2 + i, 0.0)]
    assert isinstance(results[0], CompleteGroup)
    assert buf.watermark(0) == 6


def test_timeout_expiry() -> None:
    buf = buffer()
    buf.add(scored("old", 0), 0, 0, now=0.0)
    buf.add(scored("new", 0), 0, 1, now=5.0)
    assert buf.expire(9.9) == []
    (drop,) = buf.expire(10.0)
    assert (drop.task_id, drop.reason) == ("old", "timeout")
    assert "1 of 4" in drop.detail
    assert [g.task_id for g in buf.open_groups(0)] == ["new"]
    assert buf.watermark(0) == 1
    assert buf.add(scored("old", 1), 0, 2, 11.0) == []  # a late sample of the dropped group


def test_watermark_with_interleaved_groups() -> None:
    buf = buffer()
    assert buf.watermark(0) is None
    plan = [("a", 0), ("b", 0), ("a", 1), ("c", 0), ("a", 2), ("b", 1), ("a", 3)]
    marks = []
    for offset, (task, idx) in enumerate(plan):
        buf.add(scored(task, idx), 0, offset, 0.0)
        marks.append(buf.watermark(0))
    # "a" opens at 0 and holds the watermark until it completes at offset 6; then "b" (1) does
    assert marks == [0, 0, 0, 0, 0, 0, 1]
    for offset, idx in enumerate((2, 3), start=7):
        buf.add(scored("b", idx), 0, offset, 0.0)
    assert buf.watermark(0) == 3  # "c" opened at offset 3
    for offset, idx in enumerate((1, 2, 3), start=9):
        buf.add(scored("c", idx), 0, offset, 0.0)
    assert buf.watermark(0) == 12
    assert buf.watermark(1) is None


def test_partitions_are_independent_and_revoke_forgets_them() -> None:
    buf = buffer()
    buf.add(scored("a", 0), 0, 5, 0.0)
    for i in range(4):
        buf.add(scored("b", i), 1, 7 + i, 0.0)
    assert (buf.watermark(0), buf.watermark(1)) == (5, 11)
    buf.revoke([1])
    assert buf.watermark(1) is None and not buf.outcomes.known("b")
    assert buf.watermark(0) == 5 and buf.open_count() == 1
    buf.revoke([0])
    assert buf.open_count() == 0 and buf.watermark(0) is None


def test_filters_equal_rewards_and_staleness() -> None:
    buf = buffer(group_filters=load_group_filters(GroupingConfig(drop_equal_rewards=True)), max_head_offpolicyness=1)
    out = [r for i in range(4) for r in buf.add(scored("same", i, reward=1.0), 0, i, 0.0)]
    assert out[0].reason == "filtered" and "distinct_rewards refused it (rewards [1.0, 1.0, 1.0, 1.0])" in out[0].detail
    rewards = [0.0, 1.0, 0.0, 1.0]
    stale = [r for i in range(4) for r in buf.add(scored("old", i, reward=rewards[i], version=1), 0, 10 + i, 0.0, trainer_version=3)]
    assert stale[0].reason == "stale" and "2 behind" in stale[0].detail
    fresh = [r for i in range(4) for r in buf.add(scored("ok", i, reward=rewards[i], version=2), 0, 20 + i, 0.0, trainer_version=3)]
    assert isinstance(fresh[0], CompleteGroup)
    evals = [r for i in range(4) for r in buf.add(scored("ev", i, is_eval=True, version=0), 0, 30 + i, 0.0, trainer_version=9)]
    assert isinstance(evals[0], CompleteGroup)  # eval groups are never filtered


def test_memory_stays_bounded_over_many_groups() -> None:
    buf = GroupBuffer(group_timeout_seconds=5.0, dedupe_window_seconds=10.0)
    template, no = scored("x", 0, group_size=2), rejected("x", 1, group_size=2)
    offset = 0
    ended = 0
    for n in range(10_000):
        now = n * 0.01  # 100 groups per simulated second
        yes = msgspec.structs.replace(template, episode=msgspec.structs.replace(template.episode, task_id=f"t{n}"))
        for message in (yes, msgspec.structs.replace(no, task_id=f"t{n}")):
            ended += len(buf.add(message, n % 2, offset, now))
            offset += 1
        if n % 100 == 0:
            buf.outcomes.expired(now, {0: buf.watermark(0) or 0, 1: buf.watermark(1) or 0})
        assert buf.open_count() <= 1
    assert ended == 10_000
    assert len(buf.outcomes) <= 10.0 / 0.01 + 200  # the window, plus one expiry interval
    assert sum(len(g) for g in buf._open.values()) == 0


def test_failures_are_not_rejections() -> None:
    buf = buffer()
    messages = [sample_failed("f", 0, reason="RuntimeError: first"), rejected("f", 1),
                sample_failed("f", 2, reason="RuntimeError: second"), sample_failed("f", 3)]
    (drop,) = [r for i, m in enumerate(messages) for r in buf.add(m, 0, i, 0.0)]
    assert isinstance(drop, DroppedGroup) and drop.reason == "all_failed"
    assert "3 of 4 samples failed, 1 rejected" in drop.detail
    assert "(sample 0): RuntimeError: first" in drop.detail


def test_complete_group_counts_rejected_and_failed_apart() -> None:
    buf = buffer()
    messages = [scored("m", 0), rejected("m", 1), sample_failed("m", 2), sample_failed("m", 3)]
    (group,) = [r for i, m in enumerate(messages) for r in buf.add(m, 0, i, 0.0)]
    assert isinstance(group, CompleteGroup)
    assert (len(group.episodes), group.rejected, group.failed) == (1, 1, 2)

"""OutcomeLog: record, restore from changelog records, expiry against committed watermarks."""

from __future__ import annotations

import pytest

from rollstream.consumers.grouping.outcomes import OutcomeLog
from rollstream.wire import GroupOutcome


def test_record_and_known() -> None:
    log = OutcomeLog(window_seconds=10.0)
    log.record("a", "emitted", at=1.0, partition=0, max_offset=4)
    assert log.known("a") and not log.known("b")
    assert log.get("a").max_offset == 4 and len(log) == 1
    log.forget("a")
    assert not log.known("a")


def test_expiry_needs_age_and_a_passed_watermark() -> None:
    log = OutcomeLog(window_seconds=10.0)
    log.record("old-low", "emitted", 0.0, 0, 3)
    log.record("old-high", "dropped", 1.0, 0, 9)
    log.record("old-other", "emitted", 2.0, 1, 1)
    log.record("young", "emitted", 8.0, 0, 2)
    assert log.expired(now=5.0, watermarks={0: 100, 1: 100}) == []  # nothing old enough
    gone = log.expired(now=12.5, watermarks={0: 5})  # partition 1 has no watermark yet
    assert gone == [("old-low", 0)]
    assert log.known("old-high") and log.known("old-other") and log.known("young")
    assert log.expired(now=12.5, watermarks={0: 10, 1: 2}) == [("old-high", 0), ("old-other", 1)]
    assert not log.known("old-low") and len(log) == 1


def test_restore_converts_wall_clock_to_age() -> None:
    log = OutcomeLog(window_seconds=10.0)
    records = [
        GroupOutcome(task_id="a", outcome="emitted", source_partition=1, max_offset=7, at=1000.0),
        GroupOutcome(task_id="b", outcome="dropped", source_partition=1, max_offset=9, at=995.0),
    ]
    assert log.restore(records, now=50.0, wall_now=1002.0) == 2
    assert log.get("a").at == pytest.approx(48.0)
    assert log.get("b").at == pytest.approx(43.0) and log.get("b").outcome == "dropped"
    assert log.expired(now=55.0, watermarks={1: 100}) == [("b", 1)]


def test_revoke_forgets_partitions() -> None:
    log = OutcomeLog(window_seconds=10.0)
    log.record("a", "emitted", 0.0, 0, 1)
    log.record("b", "emitted", 0.0, 1, 1)
    log.revoke([1])
    assert log.known("a") and not log.known("b")


def test_negative_window_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="dedupe_window_seconds"):
        OutcomeLog(window_seconds=-1)

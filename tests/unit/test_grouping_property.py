"""Property: any interleaving, with duplicates and with a crash and restart from the committed
watermark plus the committed outcomes, ends every group exactly once."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.grouping import CompleteGroup, GroupBuffer, GroupResult, ScoredInput
from rollstream.wire import GroupOutcome
from tests.unit.test_grouping_support import failed, rejected, scored

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[ScoredInput], dict[str, int]]:
    """The messages of K groups, shuffled, some repeated; and each group's accepted count."""
    messages: list[ScoredInput] = []
    accepted: dict[str, int] = {}
    for k in range(draw(st.integers(1, 5))):
        task, size = f"t{k}", draw(st.integers(1, 4))
        kinds = draw(st.lists(st.sampled_from(["scored", "rejected"]), min_size=size, max_size=size))
        for idx, kind in enumerate(kinds):
            messages.append(scored(task, idx, size, reward=float(idx)) if kind == "scored" else rejected(task, idx, size))
        if draw(st.booleans()) and draw(st.booleans()):
            messages.append(failed(task, size))
            accepted[task] = -1  # may end as task_failed or complete, whichever comes first
        else:
            accepted[task] = kinds.count("scored")
    dupes = draw(st.lists(st.sampled_from(messages), max_size=6))
    return draw(st.permutations(messages + dupes)), accepted


def _check(results: list[GroupResult], accepted: dict[str, int]) -> None:
    tasks = [r.task_id for r in results]
    assert sorted(tasks) == sorted(accepted), f"each group must end exactly once, got {tasks}"
    for result in results:
        expected = accepted[result.task_id]
        if isinstance(result, CompleteGroup):
            assert expected != 0
            if expected > 0:
                assert len(result.episodes) == expected
        elif expected >= 0:
            assert result.reason == "all_rejected" and expected == 0


@SETTINGS
@given(streams())
def test_every_group_ends_exactly_once(stream: tuple[list[ScoredInput], dict[str, int]]) -> None:
    messages, accepted = stream
    buf = GroupBuffer(group_timeout_seconds=60.0, dedupe_window_seconds=60.0)
    results = [r for offset, m in enumerate(messages) for r in buf.add(m, 0, offset, 0.0)]
    _check(results, accepted)
    assert buf.open_count() == 0 and buf.watermark(0) == len(messages)


@SETTINGS
@given(streams(), st.data())
def test_crash_and_rebuild_from_committed_state_is_exactly_once(
    stream: tuple[list[ScoredInput], dict[str, int]], data: st.DataObject
) -> None:
    messages, accepted = stream
    crash_at = data.draw(st.integers(0, len(messages)))
    commit_points = set(data.draw(st.lists(st.integers(0, crash_at), max_size=4)))
    buf = GroupBuffer(group_timeout_seconds=60.0, dedupe_window_seconds=60.0)
    committed: list[GroupResult] = []  # results whose transaction committed
    uncommitted: list[GroupResult] = []
    watermark = 0
    for offset, message in enumerate(messages[:crash_at]):
        uncommitted += buf.add(message, 0, offset, 0.0)
        if offset in commit_points:  # one transaction: results, outcomes and the offset
            committed += uncommitted
            uncommitted = []
            watermark = buf.watermark(0) or 0
    # crash: the aborted transaction's results are lost; a new owner restores and re-reads
    restored = GroupBuffer(group_timeout_seconds=60.0, dedupe_window_seconds=60.0)
    changelog = [GroupOutcome(task_id=r.task_id, outcome="emitted", source_partition=0, max_offset=r.max_offset) for r in committed]
    restored.outcomes.restore(changelog, now=0.0, wall_now=0.0)
    for offset in range(watermark, len(messages)):
        committed += restored.add(messages[offset], 0, offset, 0.0)
    _check(committed, accepted)

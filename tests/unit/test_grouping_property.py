"""Property: any interleaving, with duplicates and with a crash and restart from the committed
watermark plus the committed outcomes, ends every group exactly once."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.episodes import failed, rejected, sample_failed, scored
from rollstream.consumers.grouping.groups import CompleteGroup, DroppedGroup, GroupBuffer, GroupResult, ScoredInput
from rollstream.wire import GroupOutcome


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[ScoredInput], dict[str, int]]:
    """The messages of K groups, shuffled, some repeated; and each group's sample kinds and
    whether a TaskFailed may end it first."""
    messages: list[ScoredInput] = []
    expected: dict[str, tuple[list[str], bool]] = {}
    builders = {"scored": lambda t, i, n: scored(t, i, n, reward=float(i)), "rejected": rejected, "failed": sample_failed}
    for k in range(draw(st.integers(1, 5))):
        task, size = f"t{k}", draw(st.integers(1, 4))
        kinds = draw(st.lists(st.sampled_from(sorted(builders)), min_size=size, max_size=size))
        messages += [builders[kind](task, idx, size) for idx, kind in enumerate(kinds)]
        task_failed = draw(st.booleans()) and draw(st.booleans())
        if task_failed:  # the group ends as task_failed or complete, whichever comes first
            messages.append(failed(task, size))
        expected[task] = (kinds, task_failed)
    dupes = draw(st.lists(st.sampled_from(messages), max_size=6))
    return draw(st.permutations(messages + dupes)), expected


def _check(results: list[GroupResult], expected: dict[str, tuple[list[str], bool]]) -> None:
    tasks = [r.task_id for r in results]
    assert sorted(tasks) == sorted(expected), f"each group must end exactly once, got {tasks}"
    for result in results:
        kinds, task_failed = expected[result.task_id]
        if isinstance(result, DroppedGroup) and result.reason == "task_failed":
            assert task_failed
        elif isinstance(result, CompleteGroup):
            counts = (len(result.episodes), result.rejected, result.failed)
            assert counts == (kinds.count("scored"), kinds.count("rejected"), kinds.count("failed"))
        elif "failed" in kinds:  # a failure is never counted as a rejection
            assert result.reason == "all_failed" and "scored" not in kinds
        else:
            assert result.reason == "all_rejected" and set(kinds) == {"rejected"}


@SETTINGS
@given(streams())
def test_every_group_ends_exactly_once(stream: tuple[list[ScoredInput], dict[str, tuple[list[str], bool]]]) -> None:
    messages, expected = stream
    buf = GroupBuffer(group_timeout_seconds=60.0, dedupe_window_seconds=60.0)
    results = [r for offset, m in enumerate(messages) for r in buf.add(m, 0, offset, 0.0)]
    _check(results, expected)
    assert buf.open_count() == 0 and buf.watermark(0) == len(messages)


@SETTINGS
@given(streams(), st.data())
def test_crash_and_rebuild_from_committed_state_is_exactly_once(
    stream: tuple[list[ScoredInput], dict[str, tuple[list[str], bool]]], data: st.DataObject
) -> None:
    messages, expected = stream
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
    _check(committed, expected)

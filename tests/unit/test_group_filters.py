"""Group filters named in the grouping config: what they see, what they drop, and how."""

from __future__ import annotations

import numpy
import pytest

from harness.episodes import rejected, scored
from rollstream.config import ConfigError, GroupingConfig
from rollstream.consumers.grouping.filters import GroupTrajectory, distinct_rewards, load_group_filters
from rollstream.consumers.grouping.groups import CompleteGroup, DroppedGroup, GroupBuffer, GroupFilters, GroupResult
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.wire.codec import group_arrays
from tests.unit import group_filter_fns


def _buffer(*paths: str, equal: bool = False) -> GroupBuffer:
    filters = load_group_filters(GroupingConfig(group_filters=list(paths), drop_equal_rewards=equal))
    return GroupBuffer(10.0, 100.0, GroupFilters(group_filters=filters))


def _group(buf: GroupBuffer, task: str, rewards: list[float], *, is_eval: bool = False, offset: int = 0) -> GroupResult:
    out = [r for i, reward in enumerate(rewards)
           for r in buf.add(scored(task, i, len(rewards), reward, is_eval=is_eval), 0, offset + i, 0.0)]
    (result,) = out
    return result


def test_an_areal_style_filter_drops_zero_variance_groups_only() -> None:
    buf = _buffer("tests.unit.group_filter_fns:varied_rewards")
    same = _group(buf, "same", [1.0] * 4)
    assert isinstance(same, DroppedGroup) and same.reason == "filtered"
    assert same.detail == ("group filter tests.unit.group_filter_fns:varied_rewards refused it "
                           "(rewards [1.0, 1.0, 1.0, 1.0])")
    assert isinstance(_group(buf, "mixed", [0.0, 1.0, 0.0, 0.0], offset=10), CompleteGroup)
    assert isinstance(_group(buf, "eval", [1.0] * 4, is_eval=True, offset=20), CompleteGroup)  # never filtered


def test_drop_equal_rewards_is_exact_equality() -> None:
    buf = _buffer(equal=True)
    assert _group(buf, "a", [0.5] * 4).reason == "filtered"  # type: ignore[union-attr]
    nearly = float(numpy.nextafter(numpy.float32(0.5), numpy.float32(1.0)))
    assert isinstance(_group(buf, "b", [0.5, 0.5, 0.5, nearly], offset=10), CompleteGroup)
    assert _group(buf, "c", [1.0], offset=20).reason == "filtered"  # type: ignore[union-attr]  # one row: nothing to compare


def test_filters_run_in_order_and_the_first_refusal_is_the_detail() -> None:
    buf = _buffer("tests.unit.group_filter_fns:varied_rewards", "tests.unit.group_filter_fns:keep_all", equal=True)
    drop = _group(buf, "t", [2.0, 2.0])
    assert isinstance(drop, DroppedGroup) and "distinct_rewards" in drop.detail


def test_a_filter_sees_the_group_padded_as_the_trainer_gets_it() -> None:
    group_filter_fns.SEEN.clear()
    buf = _buffer("tests.unit.group_filter_fns:keep_all")
    out = []
    out += buf.add(scored("t", 0, 3, 0.25, gen_len=2, rows=2), 0, 0, 0.0)
    out += buf.add(rejected("t", 1, 3), 0, 1, 0.0)
    out += buf.add(scored("t", 2, 3, 0.75, gen_len=4), 0, 2, 0.0)
    assert isinstance(out[0], CompleteGroup)
    (seen,) = group_filter_fns.SEEN
    assert seen["task_id"] == "t" and seen["rejected"] == 1
    assert seen["rewards"].tolist() == [0.25, 0.25, 0.75] and seen["rewards"].dtype == numpy.float32
    assert seen["input_ids"].shape == (3, 6) and seen["attention_mask"].tolist()[0] == [True] * 4 + [False] * 2
    assert seen["versions"][0].tolist() == [-1, -1, 0, 0, -1, -1]  # padded with -1, as in batches


def test_a_filter_sees_the_padding_the_emitted_group_carries() -> None:
    """``grouping.pad_value`` pads what a filter judges exactly as it pads the batch record."""
    group_filter_fns.SEEN.clear()
    config = GroupingConfig(group_filters=["tests.unit.group_filter_fns:keep_all"], pad_value=-3.0)
    buf = GroupBuffer(10.0, 100.0, GroupFilters(group_filters=load_group_filters(config)))
    out = buf.add(scored("t", 0, 2, 0.25, gen_len=2), 0, 0, 0.0) + buf.add(scored("t", 1, 2, 0.75, gen_len=5), 0, 1, 0.0)
    (complete,) = out
    assert isinstance(complete, CompleteGroup)
    emitted = group_arrays(build_emitted_group(complete, 0, config.pad_value))
    (seen,) = group_filter_fns.SEEN
    assert seen["logprobs"][0].tolist()[-3:] == [-3.0] * 3
    for key in ("input_ids", "loss_mask", "logprobs", "versions", "attention_mask"):
        assert seen[key].tolist() == emitted[key].tolist(), key


def test_a_filter_that_raises_drops_the_group_naming_the_error() -> None:
    drop = _group(_buffer("tests.unit.group_filter_fns:broken"), "t", [0.0, 1.0])
    assert isinstance(drop, DroppedGroup) and drop.reason == "filtered"
    assert drop.detail == "group filter tests.unit.group_filter_fns:broken raised RuntimeError: filter bug"


@pytest.mark.parametrize(("path", "needle"), [
    ("tests.unit.group_filter_fns:nope", "grouping.group_filters[0] 'tests.unit.group_filter_fns:nope': cannot import"),
    ("no_such_module.fn", "grouping.group_filters[0] 'no_such_module.fn': cannot import"),
    ("tests.unit.group_filter_fns:NOT_CALLABLE", "is not callable"),
    ("fn", "must look like"),
    ("rollstream.consumers.group_filters:distinct_rewards",  # a module that moved: its new name
     "the module is rollstream.consumers.grouping.filters ('rollstream.consumers.grouping.filters:distinct_rewards')"),
])
def test_a_bad_filter_fails_the_start_naming_the_setting(path: str, needle: str) -> None:
    with pytest.raises(ConfigError, match="invalid configuration") as info:
        load_group_filters(GroupingConfig(group_filters=[path]))
    assert needle in str(info.value)


def test_distinct_rewards_reads_only_the_rewards() -> None:
    group = CompleteGroup("t", 2, False, (scored("t", 0, 2, 1.0), scored("t", 1, 2, 0.0)), 0, 0, 0, 1, 0.0)
    view = GroupTrajectory(group)
    assert distinct_rewards(view) and view._padded is None  # nothing padded for it
    assert view.group_size == 2 and view.head_version == 0 and len(view) == 6 and "rewards" in view

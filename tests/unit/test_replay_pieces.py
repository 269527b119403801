"""Replay building blocks without a broker: filters, start positions, resume file, JSON, summaries."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from harness.fakes import make_tokenizer
from harness.trajectories import multi_turn, scored, single_turn
from rollstream.tools.filters import RecordFilter
from rollstream.tools.positions import (
    ALL_PARTITIONS,
    load_resume,
    parse_offset_specs,
    parse_since,
    save_resume,
    start_offsets,
)
from rollstream.tools.render import message_json, summary_line
from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.wire import (
    DeadLetter,
    EmittedGroup,
    GroupDropped,
    PromptTask,
    SampleRejected,
    decode_group,
    decode_scored,
    encode,
)
from rollstream.wire.torch_tensors import pack_tensor_dict


def test_filter_by_task_version_eval_and_reward() -> None:
    train = scored(single_turn("hello", "world again", [2, 3]), 0.5, task_id="a")
    evaluation = scored(single_turn("hello", "world again", [5, 5]), 1.0, task_id="b", is_eval=True)
    prompt = PromptTask(task_id="a", group_size=2, data={})
    assert RecordFilter().accepts(prompt) and not RecordFilter().active
    assert RecordFilter(task_ids=frozenset({"a"})).accepts(prompt)
    assert not RecordFilter(task_ids=frozenset({"b"})).accepts(train)
    versions = RecordFilter(min_version=3, max_version=4)
    assert versions.accepts(train) and not versions.accepts(evaluation)
    assert not versions.accepts(prompt)  # no version: left out when a version range is set
    assert RecordFilter(is_eval=True).accepts(evaluation) and not RecordFilter(is_eval=True).accepts(train)
    assert RecordFilter(is_eval=False).accepts(SampleRejected(task_id="a", sample_idx=0, group_size=1))
    assert RecordFilter(min_reward=0.9).accepts(evaluation) and not RecordFilter(max_reward=0.4).accepts(train)
    assert not RecordFilter(min_reward=0.0).accepts(GroupDropped(task_id="a", reason="stale"))


def two_row_batch() -> EmittedGroup:
    """A batch of a group of two one-row samples."""
    rows = concat_padded_tensors([single_turn("hello", "world", [4], reward=0.5), single_turn("hi", "there", [4], 1.5)])
    return decode_group(encode(EmittedGroup(
        task_id="b", group_size=2, sample_idx=[0, 1], tail_version=4, packed=pack_tensor_dict(rows),
    )))


def test_filter_batches_by_task_and_mean_reward() -> None:
    batch = two_row_batch()
    assert RecordFilter(min_reward=1.0, max_reward=1.0).accepts(batch)  # mean of 0.5 and 1.5
    assert RecordFilter(task_ids=frozenset({"b", "z"}), min_version=4, min_reward=0.5).accepts(batch)
    assert not RecordFilter(task_ids=frozenset({"a"})).accepts(batch)
    letter = DeadLetter(tier="x", source_topic="t", partition=0, offset=1, key=b"a", value=b"", reason="r")
    assert RecordFilter(task_ids=frozenset({"a"})).accepts(letter)


def test_parse_offsets_and_since() -> None:
    assert parse_offset_specs(["0:15", "1:7"]) == {0: 15, 1: 7}
    assert parse_offset_specs(["3"]) == {ALL_PARTITIONS: 3}
    for bad in ("x", "0:", "-1:4", "1:-4"):
        with pytest.raises(ValueError, match="--offset"):
            parse_offset_specs([bad])
    assert parse_since("1700000000000") == 1_700_000_000_000
    assert parse_since("2023-11-14T22:13:20Z") == 1_700_000_000_000
    assert parse_since("2023-11-14T22:13:20") == 1_700_000_000_000  # naive = UTC
    assert parse_since("2023-11-14T23:13:20+01:00") == 1_700_000_000_000
    with pytest.raises(ValueError, match="--since"):
        parse_since("yesterday")


def test_start_offsets_precedence_and_clamping() -> None:
    begin, end = {0: 2, 1: 0, 2: 0}, {0: 10, 1: 5, 2: 8}
    assert start_offsets([0, 1, 2], begin, end) == {0: 2, 1: 0, 2: 0}
    assert start_offsets([0, 1, 2], begin, end, offsets={1: 3, ALL_PARTITIONS: 99}) == {0: 10, 1: 3, 2: 8}
    assert start_offsets([0, 1, 2], begin, end, offsets={0: 0}) == {0: 2, 1: 0, 2: 0}
    assert start_offsets([0, 1, 2], begin, end, since={0: 4, 1: None, 2: 1}) == {0: 4, 1: 5, 2: 1}
    resumed = start_offsets([0, 1, 2], begin, end, offsets={0: 3}, resume={0: 9, 2: 8})
    assert resumed == {0: 9, 1: 0, 2: 8}


def test_resume_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "resume.json"
    assert load_resume(path, "topic") is None
    save_resume(path, "topic", {1: 4, 0: 7})
    assert load_resume(path, "topic") == {0: 7, 1: 4}
    assert [p.name for p in path.parent.iterdir()] == ["resume.json"]  # no temporary left behind
    with pytest.raises(ValueError, match="belongs to topic"):
        load_resume(path, "other")
    path.write_text("{")
    with pytest.raises(ValueError, match="not usable"):
        load_resume(path, "topic")


def test_message_json_is_deterministic_and_round_trips_values() -> None:
    message = decode_scored(encode(scored(multi_turn(), 0.25, task_id="q/1")))
    first, second = message_json(message), message_json(decode_scored(encode(message)))
    assert first == second
    data = json.loads(first)
    assert data["kind"] == "scored" and data["episode"]["kind"] == "episode"
    assert data["episode"]["trajectory"]["versions"]["values"][0][-1] == 5
    summary = json.loads(message_json(message, "summary"))["episode"]["trajectory"]["input_ids"]
    assert summary["dtype"] == "int32" and summary["shape"] == [1, 11] and len(summary["sha1"]) == 16


def test_batches_render_their_tensors() -> None:
    packed = json.loads(message_json(two_row_batch(), "summary"))
    assert packed["tensors"]["input_ids"]["shape"][0] == 2 and len(packed["tensors"]["input_ids"]["sha1"]) == 16
    assert sorted(packed["packed"]["keys"]) == sorted(packed["tensors"])
    assert packed["packed"]["nbytes"] > 0 and "data" not in packed["packed"]
    full = json.loads(message_json(two_row_batch()))
    assert full["tensors"]["rewards"]["values"] == [0.5, 1.5]
    line = summary_line(two_row_batch())
    assert "task=b group_size=2 shape=[2, " in line and "reward_mean=1" in line, line


def test_summary_lines() -> None:
    line = summary_line(scored(multi_turn(), 0.25, task_id="q1", sample_idx=1))
    assert line.startswith("scored ")
    for part in ("task=q1", "sample=1/2", "v=3..5", "reward=0.25", "stop=stop", "len=4+7"):
        assert part in line
    decoded = summary_line(scored(single_turn("hello", "world <eos>", [1, 1]), 1.0), make_tokenizer())
    assert "completion: 'world <eos>'" in decoded
    assert summary_line(GroupDropped(task_id="q2", reason="stale")).startswith("dropped     task=q2 reason=stale")


def test_batch_lines_show_rejected_and_failed_counts() -> None:
    batch = msgspec.structs.replace(two_row_batch(), group_size=5, rejected=1, failed=2)
    assert summary_line(batch).endswith("rejected=1 failed=2")
    assert summary_line(two_row_batch()).endswith("rejected=0 failed=0")

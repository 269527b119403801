"""Trajectory dump lines: the fields, the two fixes over the reference, rows, batches, config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.fakes import ids, make_tokenizer
from harness.trajectories import episode, multi_turn, scored, single_turn
from rollstream.config import ConfigError, config_from_dict
from rollstream.dump.lines import DUMP_FIELDS, EXTENDED_FIELDS, DumpWriter, dump_lines, dump_record
from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.trajectory.rows import TrajectoryBuilder
from rollstream.wire import EmittedGroup, Episode, SampleRejected
from rollstream.wire.torch_tensors import encode_tensor_dict, pack_tensor_dict


def test_single_turn_fields() -> None:
    record = dump_record(scored(single_turn("what is two plus two", "four <eos>", [2, 3]), 1.0), make_tokenizer())
    assert list(record) == list(DUMP_FIELDS)
    assert record["task_id"] == "task-1" and record["sample_idx"] == 0
    assert record["seqlen"] == 7 and record["prompt_len"] == 5
    # fix 1: head is the oldest GENERATED token's version, not the prompt's -1
    assert (record["head_version"], record["tail_version"]) == (2, 3)
    assert record["reward"] == 1.0
    assert record["prompt"] == "what is two plus two"
    assert record["completion"] == "four <eos>"  # special tokens kept


def test_multi_turn_prompt_len_counts_tokens_before_first_generated_token() -> None:
    record = dump_record(scored(multi_turn(), 0.25), make_tokenizer())
    assert record["seqlen"] == 11
    # fix 2: the reference's seqlen - sum(loss_mask) = 7 counts the user retry as prompt
    assert record["prompt_len"] == 4
    assert (record["head_version"], record["tail_version"]) == (3, 5)
    assert record["prompt"] == "<|user|> what is two"
    assert record["completion"] == "<|assistant|> five <|user|> try again <|assistant|> four"
    assert record["reward"] == 0.25  # a one-row scored episode: the message's reward


def test_rows_of_a_padded_episode_each_get_a_line_keyed_by_row() -> None:
    rows = concat_padded_tensors([
        single_turn("what is two", "four", [1], reward=0.5),
        single_turn("hello", "world again <eos>", [1, 2, 2], reward=-1.0),
    ])
    lines = dump_lines(episode(rows), make_tokenizer())
    assert [line.record["seqlen"] for line in lines] == [4, 4]
    assert [line.record["prompt_len"] for line in lines] == [3, 1]
    assert [line.record["reward"] for line in lines] == [0.5, -1.0]
    assert [line.tail_version for line in lines] == [1, 2]
    assert lines[0].record["completion"] == "four"  # padding is not part of the sequence
    # (task_id, sample_idx) is shared by the two rows: "row" tells them apart, after the nine
    assert [list(line.record) for line in lines] == [[*DUMP_FIELDS, "row"]] * 2
    assert [line.record["row"] for line in lines] == [0, 1]


def test_no_generated_token_and_no_tokenizer() -> None:
    builder = TrajectoryBuilder()
    builder.add_prompt(ids("hello world"))
    record = dump_record(episode_without_output(builder.to_tensors()), None)
    assert record["prompt_len"] == record["seqlen"] == 2
    assert (record["head_version"], record["tail_version"]) == (-1, -1)
    assert record["prompt"] is None and record["completion"] is None and record["reward"] is None


def episode_without_output(tensors: dict[str, torch.Tensor]) -> Episode:
    return Episode(task_id="t", sample_idx=0, group_size=1, trajectory=encode_tensor_dict(tensors))


def test_batches_dump_one_line_per_row_with_their_task() -> None:
    rows = concat_padded_tensors([
        single_turn("hello", "world", [4], 1.0), single_turn("what", "is two", [5, 6], 0.0),
        single_turn("what", "four", [6], 0.5),
    ])
    batch = EmittedGroup(task_id="b", group_size=3, sample_idx=[0, 2, 2], tail_version=6, trainer_version=7, rejected=1,
                  packed=pack_tensor_dict(rows))
    lines = dump_lines(batch, make_tokenizer())
    assert [(line.task_id, line.tail_version, line.record["reward"]) for line in lines] == [
        ("b", 4, 1.0), ("b", 6, 0.0), ("b", 6, 0.5)]
    assert [line.record.get("row") for line in lines] == [None, 0, 1]  # sample 2 has two rows
    extended = dump_lines(batch, make_tokenizer(), fields="extended")
    assert [list(line.record) for line in extended] == [[*DUMP_FIELDS, *EXTENDED_FIELDS]] * 3
    assert [(r.record["row"], r.record["group_size"], r.record["trainer_version"], r.record["stop_reason"])
            for r in extended] == [(0, 3, 7, None), (0, 3, 7, None), (1, 3, 7, None)]


def test_rejections_are_not_dumped() -> None:
    assert dump_lines(SampleRejected(task_id="t", sample_idx=0, group_size=1), None) == []


def test_writer_from_config_names_the_missing_tokenizer_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rollout.tokenizer_path"):
        DumpWriter.from_config(config_from_dict({}))
    make_tokenizer().save_pretrained(tmp_path / "tok")
    config = config_from_dict({
        "rollout": {"tokenizer_path": str(tmp_path / "tok"), "fileroot": str(tmp_path / "d")},
        "experiment": {"experiment_name": "e", "trial_name": "t"},
    })
    writer = DumpWriter.from_config(config)
    assert (writer.root, writer.experiment, writer.trial, writer.fields) == (tmp_path / "d", "e", "t", "reference")
    extended = config_from_dict({
        "rollout": {"tokenizer_path": str(tmp_path / "tok")}, "dump": {"fields": "extended"}})
    assert DumpWriter.from_config(extended).fields == "extended"
    with pytest.raises(ConfigError, match="dump.fields"):
        config_from_dict({"dump": {"fields": "everything"}})

"""build_emitted_group: one record per group; shapes, dtypes, padding, rewards, row bookkeeping,
versions and staleness; its packed tensors equal what ``concat_padded_tensors`` pads from the
episodes' rows."""

from __future__ import annotations

import numpy
import pytest
import torch

from harness.episodes import scored
from rollstream.consumers.grouping.records import align_keys, build_emitted_group, drop_record, episode_rows
from rollstream.consumers.grouping.groups import CompleteGroup, DroppedGroup
from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.wire import decode_group, encode
from rollstream.wire.torch_tensors import group_tensors


def group(task: str, episodes: list, is_eval: bool = False) -> CompleteGroup:
    return CompleteGroup(task, len(episodes) + 1, is_eval, tuple(episodes), 1, 0, 0, 9, 0.0)


def test_shapes_dtypes_and_padding() -> None:
    g = group("a", [scored("a", 0, reward=1.0, gen_len=3, version=2), scored("a", 2, reward=0.0, gen_len=5, version=3),
                    scored("a", 1, reward=0.5, gen_len=1, version=4, rows=2)])
    batch = decode_group(encode(build_emitted_group(g, trainer_version=6, pad_value=7.0)))
    t = group_tensors(batch)
    assert t["input_ids"].shape == (4, 7) and t["input_ids"].dtype == torch.int32
    assert t["attention_mask"].dtype == torch.bool and t["versions"].dtype == torch.int32
    assert t["rewards"].dtype == torch.float32 and t["rewards"].tolist() == [1.0, 0.0, 0.5, 0.5]
    row0 = t["versions"][0].tolist()
    assert row0 == [-1, -1, 2, 2, 2, -1, -1]  # prompt -1, generated 2, padding -1 (never pad_value)
    assert t["attention_mask"][0].tolist() == [True] * 5 + [False] * 2
    assert t["input_ids"][0, 5:].tolist() == [7, 7] and t["logprobs"][3, 3:].tolist() == [7.0] * 4
    assert batch.task_id == "a" and batch.group_size == 4 and batch.sample_idx == [0, 2, 1, 1]
    assert (batch.head_version, batch.tail_version, batch.staleness) == (2, 4, 4)
    assert batch.trainer_version == 6 and not batch.is_eval


@pytest.mark.parametrize("pad_value", [0.0, 7.0])
def test_packed_tensors_equal_concat_padded_tensors(pad_value: float) -> None:
    g = group("a", [scored("a", 0, gen_len=3, version=2), scored("a", 1, gen_len=9, version=3, rows=2),
                    scored("a", 2, gen_len=0), scored("a", 3, gen_len=5, version=4)])
    batch = build_emitted_group(g, trainer_version=5, pad_value=pad_value)
    assert batch.schema_version == 3
    rows = [{k: torch.from_numpy(v) for k, v in episode_rows(e).items()} for e in g.episodes]
    want = concat_padded_tensors(align_keys(rows, pad_value), pad_value)
    for got in (group_tensors(batch), group_tensors(decode_group(encode(batch)))):
        assert list(got) == list(want)
        for key, value in want.items():
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), key


def test_one_episode_batch_equals_its_rows() -> None:
    ep = scored("a", 0, gen_len=4, version=1, rows=3)
    batch = build_emitted_group(group("a", [ep]), trainer_version=1)
    want = episode_rows(ep)
    got = group_tensors(decode_group(encode(batch)))
    assert list(got) == list(want) and all(numpy.array_equal(got[k].numpy(), want[k]) for k in want)


def test_no_generated_tokens_means_no_staleness() -> None:
    batch = build_emitted_group(group("a", [scored("a", 0, gen_len=0)]), trainer_version=5)
    assert (batch.head_version, batch.tail_version, batch.staleness) == (-1, -1, 0)


def test_scalar_reward_when_trajectory_has_none() -> None:
    ep = scored("a", 0, reward=0.25, rows=2)
    trajectory = dict(ep.episode.trajectory)
    del trajectory["rewards"]
    ep.episode.trajectory = trajectory
    batch = build_emitted_group(group("a", [ep]), trainer_version=0)
    assert group_tensors(batch)["rewards"].tolist() == [0.25, 0.25]


def test_an_eval_group_is_an_eval_batch() -> None:
    assert build_emitted_group(group("e", [scored("e", 0)], is_eval=True), 0).is_eval


def test_versions_are_the_groups_and_the_tag_is_never_below_the_tail() -> None:
    g = group("a", [scored("a", 0, version=3), scored("a", 1, version=5), scored("a", 2, version=1),
                    scored("a", 3, gen_len=0)])
    batch = build_emitted_group(g, trainer_version=4)
    assert (batch.head_version, batch.tail_version) == (1, 5) == tuple(g.versions)
    assert (batch.trainer_version, batch.trainer_version_known, batch.staleness) == (5, False, 4)
    kept = build_emitted_group(g, trainer_version=5)
    assert (kept.trainer_version, kept.trainer_version_known, kept.staleness) == (5, True, 4)


def test_drop_record() -> None:
    drop = DroppedGroup("t", "timeout", "2 of 4", True, 4, 1, 3, 8, 0.0)
    record = drop_record(drop, trainer_version=3)
    assert (record.task_id, record.reason, record.is_eval, record.detail, record.trainer_version) == (
        "t", "timeout", True, "2 of 4", 3,
    )


def test_batch_carries_its_groups_rejected_and_failed_counts() -> None:
    g = CompleteGroup("a", 4, False, (scored("a", 0),), 2, 0, 0, 3, 0.0, 1)
    batch = decode_group(encode(build_emitted_group(g, trainer_version=0)))
    assert (batch.rejected, batch.failed) == (2, 1)

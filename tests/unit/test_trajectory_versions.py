"""One computation of seqlen, prompt_len, head/tail versions and staleness, one answer everywhere.

The episode message (rollout worker), the dump lines and the replay filters must agree on the
same row, including the cases the reference system's contract allows and its dump got wrong:
no ``versions``, no ``loss_mask``, a generated token tagged -1, multi-turn and multi-row. The
grouping tier's staleness filter, the batch it emits and the trainer's step agree on a group's
versions and staleness.
"""

from __future__ import annotations

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.fakes import ids, make_tokenizer
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.consumers.grouping.groups import CompleteGroup, GroupFilters, apply_filters
from rollstream.dump.lines import dump_lines
from rollstream.rollout_workers.episodes import to_episode
from rollstream.tools.filters import RecordFilter, tail_version_of
from rollstream.trainer.training_step import assemble, emitted_group_rows
from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.trajectory.rows import TrajectoryBuilder
from rollstream.trajectory.staleness import (
    RowSpan,
    Versions,
    group_trainer_version,
    head_and_tail,
    row_spans,
    staleness,
    token_staleness,
)
from rollstream.wire import Episode, PromptTask, ScoredEpisode, decode_group, encode


ENGINE_VERSION = 9  # the engine's version when the episode ended: the fallback


def multi_turn_with_unknown_version() -> dict[str, torch.Tensor]:
    """prompt (3) | answer (2: v3, then -1 = unknown) | user (2) | answer (1: v4)."""
    builder = TrajectoryBuilder()
    builder.add_prompt(ids("what is two"))
    builder.add_output(ids("five <eos>"), [-0.1, -0.2], [3, -1])
    builder.add_prompt(ids("<|user|> again"))
    builder.add_output(ids("four"), [-0.3], [4])
    return builder.to_tensors(reward=1.0)


def without(td: dict[str, torch.Tensor], *keys: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in td.items() if k not in keys}


CASES = {
    # name: (trajectory, expected spans with the engine fallback)
    "full": (multi_turn_with_unknown_version(), [RowSpan(8, 3, 3, 4)]),
    # no versions: generated tokens (loss mask) are versioned by the engine, like the reference
    "no versions": (without(multi_turn_with_unknown_version(), "versions"), [RowSpan(8, 3, 9, 9)]),
    # no loss mask: generated = versioned positions (prompts carry -1)
    "no loss_mask": (without(multi_turn_with_unknown_version(), "loss_mask"), [RowSpan(8, 3, 3, 4)]),
    # neither: nothing tells prompt from answer; the whole row is prompt, versioned by the engine
    "neither": (without(multi_turn_with_unknown_version(), "loss_mask", "versions"), [RowSpan(8, 8, 9, 9)]),
}


def two_rows() -> dict[str, torch.Tensor]:
    """Two rows of different lengths (padding excluded), the second all prompt."""
    prompt_only = TrajectoryBuilder()
    prompt_only.add_prompt(ids("hello world"))
    row = prompt_only.to_tensors(reward=0.0)
    return concat_padded_tensors([multi_turn_with_unknown_version(), row])


CASES["two rows"] = (two_rows(), [RowSpan(8, 3, 3, 4), RowSpan(2, 2, -1, -1)])


@pytest.mark.parametrize("name", list(CASES))
def test_episode_dump_and_filter_agree(name: str) -> None:
    td, expected = CASES[name]
    assert row_spans(td, ENGINE_VERSION) == expected
    task = PromptTask(task_id="t", group_size=1, data={})
    message = to_episode(task, 0, td, "stop", "w", fallback_version=ENGINE_VERSION)
    assert isinstance(message, Episode)
    heads = [s.head_version for s in expected if s.head_version >= 0]
    tails = [s.tail_version for s in expected if s.tail_version >= 0]
    assert (message.head_version, message.tail_version) == (min(heads), max(tails))
    scored = ScoredEpisode(episode=message, reward=1.0)
    for shown in (message, scored):
        lines = dump_lines(shown, make_tokenizer())
        got = [(r["seqlen"], r["prompt_len"], r["head_version"], r["tail_version"]) for r in (l.record for l in lines)]
        assert got == [tuple(s) for s in expected]
        assert tail_version_of(shown) == message.tail_version
        assert RecordFilter(min_version=max(tails), max_version=max(tails)).accepts(shown)
        assert not RecordFilter(max_version=max(tails) - 1).accepts(shown)


def test_a_generated_token_of_unknown_version_is_left_out_not_taken_as_head() -> None:
    spans = row_spans(multi_turn_with_unknown_version())
    assert spans[0].head_version == 3  # not -1: the -1 token has no known version


def test_prompt_len_and_text_split_of_a_multi_turn_row() -> None:
    td = multi_turn_with_unknown_version()
    message = to_episode(PromptTask(task_id="t", group_size=1, data={}), 0, td, "stop", "w")
    record = dump_lines(message, make_tokenizer())[0].record
    # the reference's seqlen - sum(loss_mask) = 5 would count the first answer as prompt
    assert record["prompt_len"] == 3
    assert record["prompt"] == "what is two"
    assert record["completion"] == "five <eos> <|user|> again four"


def test_without_a_fallback_unversioned_tokens_stay_unknown() -> None:
    td = without(multi_turn_with_unknown_version(), "versions")
    assert row_spans(td) == [RowSpan(8, 3, -1, -1)]


def test_an_earlier_turn_not_trained_on_does_not_count() -> None:
    """A multi-turn row whose first model turn (version 1) is context, loss_mask 0, as an agent
    conversation's earlier turns can be: only the trained turn (version 5) is stale or fresh."""
    builder = TrajectoryBuilder()
    builder.add_prompt(ids("what is two"))
    builder.add_prompt(ids("five <eos>"))  # an earlier model turn, kept as context only
    builder.add_output(ids("four"), [-0.3], [5])
    td = builder.to_tensors(reward=1.0)
    td["versions"][0, 3:5] = 1  # it was generated by version 1, and says so
    assert row_spans(td) == [RowSpan(6, 5, 5, 5)]
    message = to_episode(PromptTask(task_id="t", group_size=1, data={}), 0, td, "stop", "w")
    assert isinstance(message, Episode) and (message.head_version, message.tail_version) == (5, 5)


def test_head_and_tail_combines_spans_and_skips_unknown() -> None:
    assert head_and_tail([Versions(3, 4), Versions(-1, -1), RowSpan(9, 2, 1, 2)]) == (1, 4)
    assert head_and_tail([]) == (-1, -1) and head_and_tail([Versions(-1, -1)]) == (-1, -1)
    assert head_and_tail(row_spans(two_rows())) == (3, 4)


def test_staleness_and_the_trainer_version_data_is_tagged_with() -> None:
    assert staleness(7, 4) == 3 and staleness(7, -1) == 0
    assert group_trainer_version(3, 5) == 5  # the tokens prove the trainer reached 5
    assert group_trainer_version(6, 5) == 6 and group_trainer_version(6, -1) == 6


def test_token_staleness_of_generated_tokens_of_known_version() -> None:
    versions = torch.tensor([[-1, 3, 4, -1], [-1, 2, -1, 2]], dtype=torch.int32)
    loss_mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0]], dtype=torch.int32)  # row 1: one token of no version
    assert token_staleness(5, versions, loss_mask).tolist() == [2, 1, 3]
    assert token_staleness(5, versions.numpy(), numpy.zeros((2, 4))).size == 0


def group_of(task_id: str, versions: list[list[int]]) -> CompleteGroup:
    """A train group whose sample i generated one token per version in ``versions[i]`` (made by
    the rollout worker's own to_episode)."""
    task = PromptTask(task_id=task_id, group_size=len(versions), data={})
    episodes = []
    for idx, tokens in enumerate(versions):
        builder = TrajectoryBuilder()
        builder.add_prompt(ids("what is two"))
        builder.add_output([7] * len(tokens), [-0.5] * len(tokens), tokens)
        message = to_episode(task, idx, builder.to_tensors(reward=float(idx % 2)), "stop", "w")
        assert isinstance(message, Episode)
        episodes.append(ScoredEpisode(episode=message, reward=float(idx % 2)))
    return CompleteGroup(task_id, len(versions), False, tuple(episodes), 0, 0, 0, len(versions), 0.0)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    versions=st.lists(st.lists(st.integers(-1, 8), max_size=4), min_size=1, max_size=4),
    read=st.integers(0, 8),
    eta=st.integers(0, 3),
)
def test_a_group_passes_the_stale_filter_exactly_when_its_batch_is_within_the_bound(
    versions: list[list[int]], read: int, eta: int,
) -> None:
    """The filter judges the trainer version the batch will carry (never below its newest
    token, even when Redis answered an older one), so a group that passes is never emitted
    staler than ``max_head_offpolicyness``, and one it drops would have been; the trainer's
    step, assembled from the record, says the same."""
    group = group_of("g", versions)
    passed = apply_filters(group, GroupFilters(max_head_offpolicyness=eta), read) is group
    batch = decode_group(encode(build_emitted_group(group, read)))
    assert (batch.head_version, batch.tail_version) == group.versions
    assert passed == (batch.staleness <= eta), (batch.trainer_version, batch.head_version)
    step = assemble([emitted_group_rows(batch)])
    assert (step.head_version, step.tail_version, step.max_staleness) == (
        batch.head_version, batch.tail_version, batch.staleness)


def test_a_group_redis_saw_as_fresh_is_stale_by_its_own_tokens() -> None:
    """Redis answers version 2 (it lagged); the group's tokens are of versions 1 and 4, so the
    trainer was at 4 at least: 3 behind, beyond a bound of 1 (the filter used to say 1)."""
    group = group_of("lag", [[1, 1], [4]])
    dropped = apply_filters(group, GroupFilters(max_head_offpolicyness=1), trainer_version=2)
    assert dropped is not group and dropped.reason == "stale"
    assert dropped.detail == "head version 1 is 3 behind trainer version 4 (max 1)"

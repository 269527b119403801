"""One computation of seqlen, prompt_len and head/tail versions, one answer everywhere.

The episode message (rollout worker), the dump lines and the replay filters must agree on the
same row, including the cases the reference system's contract allows and its dump got wrong:
no ``versions``, no ``loss_mask``, a generated token tagged -1, multi-turn and multi-row.
"""

from __future__ import annotations

import pytest
import torch

from rollstream.rollout_workers.episodes import to_episode
from rollstream.dump import dump_lines
from rollstream.tensors import RowSpan, TrajectoryBuilder, concat_padded_tensors, row_spans
from rollstream.tools.filters import RecordFilter, tail_version_of
from rollstream.wire import Episode, PromptTask, ScoredEpisode
from tests.unit.fakes import ids, make_tokenizer

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

"""The grouping tier's intake check of an episode's versions: what cannot be true is refused
with a reason that names it; what a real workflow and engine produce passes."""

from __future__ import annotations

import pytest

from harness.episodes import claiming, scored, trajectory
from rollstream.consumers.grouping.version_check import above_trainer, version_problem
from rollstream.wire import Episode
from rollstream.wire.torch_tensors import encode_tensor_dict


@pytest.mark.parametrize("versions, head, tail", [
    ([3, 3, 4], 3, 4),
    ([-1, -1], 5, 5),  # no known version: the worker's fallback (its engine's version) stands
    ([-1, 2], 2, 5),  # a row of unknown versions versioned by the fallback widens the span
    ([], -1, -1),
])
def test_what_workflows_and_engines_produce_passes(versions: list[int], head: int, tail: int) -> None:
    assert version_problem(claiming("t", 0, versions, head, tail).episode) is None
    assert version_problem(scored("t", 0, version=7).episode) is None


def test_a_negative_version_below_minus_one_is_named_with_its_position() -> None:
    problem = version_problem(claiming("t", 0, [3, -7, 3], 3, 3).episode)
    assert problem is not None and "-7" in problem and "[[0, 3]]" in problem


@pytest.mark.parametrize("head, tail", [(-7, -7), (4, 3), (-1, 3), (3, -1)])
def test_a_claimed_span_that_is_no_span_is_refused(head: int, tail: int) -> None:
    problem = version_problem(claiming("t", 0, [3], head, tail).episode)
    assert problem is not None and f"head_version {head} and tail_version {tail}" in problem


@pytest.mark.parametrize("versions, head, tail", [([2, 3], 3, 3), ([3, 6], 3, 5), ([4], -1, -1)])
def test_tokens_outside_the_claimed_span_are_refused(versions: list[int], head: int, tail: int) -> None:
    problem = version_problem(claiming("t", 0, versions, head, tail).episode)
    assert problem is not None and "outside" in problem and f"{head}..{tail}" in problem


def test_an_earlier_turn_not_trained_on_may_be_older_than_the_head() -> None:
    """A multi-turn row's earlier model turn (loss_mask 0) keeps its versions; only generated
    positions count, as in every other use of head and tail."""
    tensors = trajectory(prompt_len=4, gen_len=2, version=5)
    tensors["versions"][0, 1] = 2  # an earlier turn's token of version 2, loss_mask 0
    episode = Episode(task_id="t", sample_idx=0, group_size=4, trajectory=encode_tensor_dict(tensors),
                      head_version=5, tail_version=5)
    assert version_problem(episode) is None
    tensors["versions"][0, 1] = -3
    assert "-3" in (version_problem(Episode(task_id="t", sample_idx=0, group_size=4, head_version=5,
                                            tail_version=5, trajectory=encode_tensor_dict(tensors))) or "")


def test_tokens_newer_than_the_trainer_are_refused_and_others_pass() -> None:
    episode = scored("t", 0, version=9).episode
    assert above_trainer(episode, 9) is None and above_trainer(episode, 12) is None
    problem = above_trainer(episode, 3)
    assert problem is not None and "tail_version 9" in problem and "current version 3" in problem
    assert above_trainer(claiming("t", 0, [], -1, -1).episode, 0) is None


def test_versions_without_a_versions_tensor_are_judged_by_the_claim_alone() -> None:
    tensors = trajectory(gen_len=2)
    del tensors["versions"]
    episode = Episode(task_id="t", sample_idx=0, group_size=4, trajectory=encode_tensor_dict(tensors),
                      head_version=2, tail_version=2)
    assert version_problem(episode) is None

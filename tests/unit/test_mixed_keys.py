"""Trajectories with different keys meet in one batch or one trainer step: no key is dropped.

A typed result (RLVR's row, with ``is_truncated``) and a literal one (``input_ids`` +
``output_ids`` + ``reward``: no ``is_truncated``; no ``logprobs``/``versions`` when no engine
response matches its tokens) become episodes; the grouping tier batches them together, the
trainer side assembles a step across batches. Every key survives, filled where an episode
lacked it with the value padding gets, and ``<key>_present`` says which rows are real.
"""

from __future__ import annotations

import logging

import pytest
import torch

from rollstream.api.io_struct import ModelResponse
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.consumers.grouping.groups import CompleteGroup
from rollstream.trajectory.normalize import episode_tensors
from rollstream.trajectory.rows import trajectory_row
from rollstream.trainer.training_step import assemble, emitted_group_rows
from rollstream.rollout_workers.episodes import to_episode
from rollstream.wire import Episode, PromptTask, ScoredEpisode, decode_group, encode
from rollstream.wire.torch_tensors import group_tensors

PROMPT = [5, 6, 7]


def typed_result(output: list[int], truncated: bool) -> dict[str, torch.Tensor]:
    """What RLVR returns: a [1, L] row with is_truncated and rewards."""
    return episode_tensors(trajectory_row(PROMPT, output, [-0.5] * len(output), [3] * len(output),
                                          reward=1.0, is_truncated=truncated))


def literal_result(output: list[int], engine_saw_it: bool) -> dict[str, torch.Tensor]:
    """The reference guide's form; logprobs/versions only when an engine response matches."""
    responses = [ModelResponse(PROMPT, output, [-0.25] * len(output), [4] * len(output))] if engine_saw_it else []
    result = {"input_ids": torch.tensor(PROMPT), "output_ids": torch.tensor(output), "reward": torch.tensor(0.5)}
    return episode_tensors(result, responses)


def group(task_id: str, results: list[dict[str, torch.Tensor]]) -> CompleteGroup:
    """The group as the grouping tier gets it: episodes made by the rollout worker's to_episode."""
    task = PromptTask(task_id=task_id, group_size=len(results), data={})
    episodes = []
    for idx, tensors in enumerate(results):
        assert tensors["input_ids"].shape[0] == 1
        episode = to_episode(task, idx, tensors, "stop", "w")
        assert isinstance(episode, Episode)
        episodes.append(ScoredEpisode(episode=episode, reward=float(tensors["rewards"][0])))
    return CompleteGroup(task_id, len(results), False, tuple(episodes), 0, 0, 0, len(results), 0.0)


def test_a_batch_of_typed_and_literal_results_keeps_every_key_and_says_where_it_is_real(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    mixed = group("mixed", [typed_result([8, 9], truncated=True), typed_result([8], truncated=False),
                            literal_result([8, 9, 10], engine_saw_it=True), literal_result([9], engine_saw_it=False)])
    batch = decode_group(encode(build_emitted_group(mixed, trainer_version=4)))
    tensors = group_tensors(batch)
    assert tensors["is_truncated"].tolist() == [True, False, False, False]
    assert tensors["is_truncated_present"].tolist() == [True, True, False, False]
    # the literal sample no engine response matched has no logprobs/versions: kept, marked
    assert tensors["logprobs_present"].tolist() == [True, True, True, False]
    assert tensors["versions_present"].tolist() == [True, True, True, False]
    assert tensors["versions"][3].tolist() == [-1] * 6  # unknown version, like padding
    assert tensors["logprobs"][2, 3:].tolist() == [-0.25] * 3 and tensors["logprobs"][3].tolist() == [0.0] * 6
    assert (batch.head_version, batch.tail_version) == (3, 4)  # from the real tokens only
    assert tensors["is_truncated_present"].dtype == torch.bool and tensors["is_truncated"].dtype == torch.bool
    assert "dropping" not in caplog.text


def test_a_trainer_step_across_batches_keeps_the_key_and_the_mask() -> None:
    """One batch whose episodes all have is_truncated (no mask on it), one whose episodes have
    none, one that is mixed (its own mask): the step has every row's truth."""
    all_typed = build_emitted_group(group("a", [typed_result([8], truncated=True)]), trainer_version=1)
    all_literal = build_emitted_group(group("b", [literal_result([8, 9], engine_saw_it=True)]), trainer_version=1)
    mixed = build_emitted_group(group("c", [typed_result([9], truncated=True), literal_result([9], engine_saw_it=True)]),
                        trainer_version=1)
    assert "is_truncated_present" not in group_tensors(all_typed)
    step = assemble([emitted_group_rows(decode_group(encode(b))) for b in (all_typed, all_literal, mixed)])
    assert step.task_ids == ["a", "b", "c"]
    assert step.tensors["is_truncated"].tolist() == [True, False, True, False]
    assert step.tensors["is_truncated_present"].tolist() == [True, False, True, False]
    # the same rows batched as one group give the same tensors
    at_once = group_tensors(build_emitted_group(group("all", [
        typed_result([8], truncated=True), literal_result([8, 9], engine_saw_it=True),
        typed_result([9], truncated=True), literal_result([9], engine_saw_it=True),
    ]), trainer_version=1))
    assert list(step.tensors) == list(at_once)
    for key, value in at_once.items():
        assert torch.equal(step.tensors[key], value), key

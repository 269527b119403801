"""to_episode for every workflow return form, and malformed results as failed samples."""

from __future__ import annotations

import math

import pytest
import torch

from rollstream.api.io_struct import ModelRequest, ModelResponse
from rollstream.api.workflow import Interaction
from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.trajectory.rows import trajectory_row
from rollstream.wire import Episode, PromptTask, SampleRejected, decode_episode, encode
from rollstream.wire.torch_tensors import decode_tensor_dict
from rollstream.rollout_workers.episodes import to_episode

TASK = PromptTask(task_id="task-1", group_size=4, data={"input_ids": [3, 4], "answer": "7"}, is_eval=True)


def _row(versions: list[int], reward: float | None = 1.0) -> dict[str, torch.Tensor]:
    out = list(range(10, 10 + len(versions)))
    return trajectory_row([3, 4], out, [-0.5] * len(out), versions, reward=reward, is_truncated=False)


def _roundtrip(message: Episode | SampleRejected) -> Episode | SampleRejected:
    decoded = decode_episode(encode(message))
    assert type(decoded) is type(message)
    return decoded


def test_tensor_dict_becomes_episode() -> None:
    msg = to_episode(TASK, 2, _row([0, 0, 1]), "length", "w1")
    assert isinstance(msg, Episode)
    assert (msg.task_id, msg.sample_idx, msg.group_size, msg.is_eval) == ("task-1", 2, 4, True)
    assert (msg.head_version, msg.tail_version) == (0, 1)
    assert msg.stop_reason == "length" and msg.worker_id == "w1" and msg.has_reward
    assert msg.data == TASK.data and msg.generated_at > 0
    decoded = _roundtrip(msg)
    td = decode_tensor_dict(decoded.trajectory)
    assert td["input_ids"].tolist() == [[3, 4, 10, 11, 12]]
    assert td["versions"].tolist() == [[-1, -1, 0, 0, 1]]
    assert td["loss_mask"].tolist() == [[0, 0, 1, 1, 1]]


def test_without_rewards_has_reward_false() -> None:
    msg = to_episode(TASK, 0, _row([0], reward=None), "stop", "w")
    assert isinstance(msg, Episode) and not msg.has_reward


def test_nothing_generated_gives_minus_one_versions() -> None:
    msg = to_episode(TASK, 0, _row([]), "stop", "w")
    assert isinstance(msg, Episode)
    assert (msg.head_version, msg.tail_version) == (-1, -1)


def test_multi_row_dict_uses_generated_positions_only() -> None:
    td = concat_padded_tensors([_row([2, 3]), _row([5])])  # padding: versions -1, loss_mask 0
    msg = to_episode(TASK, 1, td, "stop", "w")
    assert isinstance(msg, Episode) and (msg.head_version, msg.tail_version) == (2, 5)


def test_version_range_ignores_prompt_positions_without_loss_mask_one() -> None:
    td = _row([4, 4])
    td["versions"][0, :2] = 0  # a workflow that tags its prompt with version 0
    msg = to_episode(TASK, 1, td, "stop", "w")
    assert isinstance(msg, Episode) and (msg.head_version, msg.tail_version) == (4, 4)
    del td["loss_mask"]
    msg = to_episode(TASK, 1, td, "stop", "w")  # no loss mask: every real version counts
    assert isinstance(msg, Episode) and (msg.head_version, msg.tail_version) == (0, 4)


def test_none_is_a_rejection_not_a_failure() -> None:
    msg = to_episode(TASK, 3, None, "stop", "w")
    assert isinstance(msg, SampleRejected)
    assert (msg.reason, msg.failed, msg.sample_idx, msg.is_eval) == ("rejected", False, 3, True)
    _roundtrip(msg)


def test_interactions_become_rows() -> None:
    def inter(out: list[int], version: int, reward: float | None) -> Interaction:
        req = ModelRequest(input_ids=[3, 4])
        resp = ModelResponse(input_tokens=[3, 4], output_tokens=out, output_logprobs=[-0.1] * len(out),
                             output_versions=[version] * len(out), stop_reason="stop")
        return Interaction(request=req, response=resp, reward=reward)

    msg = to_episode(TASK, 0, {"a": inter([9], 1, None), "b": inter([9, 8], 2, 1.0)}, "stop", "w")
    assert isinstance(msg, Episode)
    td = decode_tensor_dict(_roundtrip(msg).trajectory)
    assert td["input_ids"].shape == (2, 4)
    assert td["rewards"].tolist() == [0.0, 1.0]
    assert (msg.head_version, msg.tail_version) == (1, 2) and msg.has_reward


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda td: td.update(input_ids=td["input_ids"].long() + 2**40), "'input_ids' has dtype torch.int64 and values"),
        (lambda td: td.update(logprobs=td["logprobs"][:, :-1]), "shape"),
        (lambda td: td["logprobs"].__setitem__((0, 3), math.nan), "NaN"),
        (lambda td: td.update({k: v.repeat(2, 1) for k, v in td.items() if k != "rewards"}) or td.pop("attention_mask"),
         "lacks 'attention_mask'"),
        (lambda td: td.update(rewards=torch.tensor([[1.0]])), "rewards"),
        (lambda td: td.update(input_ids=td["input_ids"][0]), "input_ids"),
        (lambda td: td.update(extra=[1, 2]), "only tensors"),
        (lambda td: td.update(extra=torch.zeros(1, dtype=torch.complex64)), "encode"),
    ],
)
def test_malformed_tensors_become_failed_samples(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    td = _row([0, 0])
    mutate(td)
    msg = to_episode(TASK, 1, td, "stop", "w")
    assert isinstance(msg, SampleRejected)
    assert msg.failed and needle in msg.reason, msg.reason
    _roundtrip(msg)


@pytest.mark.parametrize("result", [42, "text", {}, [torch.zeros(1)], {"a": 1}])
def test_wrong_return_types_become_failed_samples(result: object) -> None:
    msg = to_episode(TASK, 0, result, "stop", "w")
    assert isinstance(msg, SampleRejected) and msg.failed


def test_interactions_with_inconsistent_outputs_fail() -> None:
    resp = ModelResponse(input_tokens=[3], output_tokens=[5, 6], output_logprobs=[-0.1], output_versions=[0, 0])
    msg = to_episode(TASK, 0, {"x": Interaction(ModelRequest(input_ids=[3]), resp)}, "stop", "w")
    assert isinstance(msg, SampleRejected) and msg.failed and "interactions" in msg.reason


def test_long_reasons_are_cut() -> None:
    td = _row([0])
    td["extra" * 300] = [1]  # type: ignore[assignment]
    msg = to_episode(TASK, 0, td, "stop", "w")
    assert isinstance(msg, SampleRejected) and len(msg.reason) <= 500

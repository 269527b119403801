"""Scored episodes, rejected samples and failed tasks as the grouping tier reads them, built for tests."""

from __future__ import annotations

import torch

from rollstream.consumers.grouping.groups import CompleteGroup
from rollstream.wire import Episode, SampleRejected, ScoredEpisode, TaskFailed
from rollstream.wire.torch_tensors import encode_tensor_dict


def scored(
    task_id: str,
    idx: int,
    group_size: int = 4,
    reward: float = 1.0,
    *,
    is_eval: bool = False,
    version: int = 0,
    gen_len: int = 3,
    rows: int = 1,
) -> ScoredEpisode:
    """A scored sample whose generated tokens all carry ``version`` (``gen_len`` 0: none)."""
    tensors = trajectory(gen_len=gen_len, version=version, rows=rows)
    tensors["rewards"] = torch.full((rows,), reward, dtype=torch.float32)
    episode = Episode(
        task_id=task_id,
        sample_idx=idx,
        group_size=group_size,
        trajectory=encode_tensor_dict(tensors),
        is_eval=is_eval,
        head_version=version if gen_len else -1,
        tail_version=version if gen_len else -1,
        has_reward=True,
    )
    return ScoredEpisode(episode=episode, reward=reward)


def claiming(task_id: str, idx: int, versions: list[int], head: int, tail: int, group_size: int = 4) -> ScoredEpisode:
    """A scored sample of 2 prompt tokens and one generated token per entry of ``versions``
    (as a workflow wrote them), whose message claims the span ``head``..``tail``."""
    tensors = trajectory(gen_len=len(versions))
    tensors["versions"][0, 2:] = torch.tensor(versions, dtype=torch.int32)
    tensors["rewards"] = torch.ones(1, dtype=torch.float32)
    episode = Episode(task_id=task_id, sample_idx=idx, group_size=group_size, trajectory=encode_tensor_dict(tensors),
                      head_version=head, tail_version=tail, has_reward=True)
    return ScoredEpisode(episode=episode, reward=1.0)


def rejected(task_id: str, idx: int, group_size: int = 4, *, is_eval: bool = False) -> SampleRejected:
    return SampleRejected(task_id=task_id, sample_idx=idx, group_size=group_size, is_eval=is_eval)


def sample_failed(task_id: str, idx: int, group_size: int = 4, reason: str = "ValueError: boom") -> SampleRejected:
    """A sample whose workflow (or reward function) raised."""
    return SampleRejected(task_id=task_id, sample_idx=idx, group_size=group_size, reason=reason, failed=True)


def failed(task_id: str, group_size: int = 4) -> TaskFailed:
    return TaskFailed(task_id=task_id, group_size=group_size, reason="boom")


def trajectory(prompt_len: int = 2, gen_len: int = 3, version: int = 0, rows: int = 1) -> dict[str, torch.Tensor]:
    """``rows`` sequences of ``prompt_len`` prompt tokens and ``gen_len`` tokens of ``version``."""
    length = prompt_len + gen_len
    ids = torch.arange(1, length + 1, dtype=torch.int32).repeat(rows, 1)
    loss = torch.tensor([0] * prompt_len + [1] * gen_len, dtype=torch.int32).repeat(rows, 1)
    versions = torch.tensor([-1] * prompt_len + [version] * gen_len, dtype=torch.int32).repeat(rows, 1)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones((rows, length), dtype=torch.bool),
        "loss_mask": loss,
        "logprobs": torch.where(loss.bool(), -0.5, 0.0).to(torch.float32),
        "versions": versions,
    }


def group(task: str, versions: list[int]) -> CompleteGroup:
    episodes = tuple(scored(task, i, group_size=len(versions), version=v) for i, v in enumerate(versions))
    return CompleteGroup(task, len(versions), False, episodes, 1, 0, 0, 9, 0.0)

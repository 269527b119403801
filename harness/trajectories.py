"""Trajectories of one and several turns and their scored episodes, built for the dump and replay tests."""

from __future__ import annotations


import torch

from harness.fakes import ids
from rollstream.trajectory.rows import TrajectoryBuilder
from rollstream.wire import Episode, ScoredEpisode
from rollstream.wire.torch_tensors import encode_tensor_dict


def single_turn(prompt: str, output: str, versions: list[int], reward: float | None = None) -> dict[str, torch.Tensor]:
    builder = TrajectoryBuilder()
    builder.add_prompt(ids(prompt))
    out = ids(output)
    builder.add_output(out, [-0.5] * len(out), versions)
    return builder.to_tensors(reward=reward)


def multi_turn() -> dict[str, torch.Tensor]:
    """prompt (4) | turn 1 (2 tokens, v3) | user retry (3) | turn 2 (2 tokens, v4, v5)."""
    builder = TrajectoryBuilder()
    builder.add_prompt(ids("<|user|> what is two"))
    builder.add_output(ids("<|assistant|> five"), [-0.1, -0.2], [3, 3])
    builder.add_prompt(ids("<|user|> try again"))
    builder.add_output(ids("<|assistant|> four"), [-0.3, -0.4], [4, 5])
    return builder.to_tensors(reward=1.0)


def scored(tensors: dict[str, torch.Tensor], reward: float, **kw: object) -> ScoredEpisode:
    return ScoredEpisode(episode=episode(tensors, **kw), reward=reward)  # type: ignore[arg-type]


def episode(
    tensors: dict[str, torch.Tensor], task_id: str = "task-1", sample_idx: int = 0,
    group_size: int = 2, is_eval: bool = False,
) -> Episode:
    versions = tensors["versions"][tensors["loss_mask"].bool()]
    return Episode(
        task_id=task_id, sample_idx=sample_idx, group_size=group_size,
        trajectory=encode_tensor_dict(tensors), is_eval=is_eval,
        head_version=int(versions.min()), tail_version=int(versions.max()),
    )

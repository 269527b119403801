"""Rows of a group of episodes as the trainer lays them out, built for the layout tests."""

from __future__ import annotations

import torch

from rollstream.trainer.training_step import GroupRows


def row(prompt: list[int], turns: list[tuple[list[int], bool]], version: int, reward: float) -> dict[str, torch.Tensor]:
    """One ``[1, L]`` row: prompt tokens, then segments that are generated (True) or not (a
    multi-turn retry prompt); generated token ``t`` has logprob ``-t/100``."""
    ids, loss, versions = list(prompt), [0] * len(prompt), [-1] * len(prompt)
    for tokens, generated in turns:
        ids += tokens
        loss += [int(generated)] * len(tokens)
        versions += [version if generated else -1] * len(tokens)
    logprobs = [-(t / 100) if m else 0.0 for t, m in zip(ids, loss)]
    return {
        "input_ids": torch.tensor([ids], dtype=torch.int32),
        "attention_mask": torch.ones((1, len(ids)), dtype=torch.bool),
        "loss_mask": torch.tensor([loss], dtype=torch.int32),
        "logprobs": torch.tensor([logprobs], dtype=torch.float32),
        "versions": torch.tensor([versions], dtype=torch.int32),
        "rewards": torch.tensor([reward], dtype=torch.float32),
    }


def group(task: str, rows: list[dict[str, torch.Tensor]]) -> GroupRows:
    from rollstream.trajectory.padding import concat_padded_tensors

    return GroupRows(task, len(rows), False, 3, concat_padded_tensors(rows), list(range(len(rows))))

"""Synthetic trajectories and messages of realistic shape for the benchmarks (no model)."""

from __future__ import annotations

import random
import time

import torch
from torch import Tensor

from rollstream.wire import Episode, ScoredEpisode
from rollstream.wire.torch_tensors import encode_tensor_dict

PROMPT_TOKENS = 512
COMPLETION_TOKENS = 1536
VOCAB = 151_936  # a Qwen-sized vocabulary: ids need the full int32 range of bytes anyway


def trajectory(prompt: int = PROMPT_TOKENS, completion: int = COMPLETION_TOKENS, seed: int = 0,
               version: int = 0, reward: float = 1.0) -> dict[str, Tensor]:
    """One ``[1, prompt + completion]`` row with every trajectory field a workflow produces."""
    gen = torch.Generator().manual_seed(seed)
    length = prompt + completion
    loss_mask = torch.zeros(1, length, dtype=torch.int32)
    loss_mask[0, prompt:] = 1
    logprobs = torch.zeros(1, length, dtype=torch.float32)
    logprobs[0, prompt:] = -torch.rand(completion, generator=gen) * 4
    versions = torch.full((1, length), -1, dtype=torch.int32)
    versions[0, prompt:] = version
    return {
        "input_ids": torch.randint(0, VOCAB, (1, length), dtype=torch.int32, generator=gen),
        "attention_mask": torch.ones(1, length, dtype=torch.bool),
        "loss_mask": loss_mask,
        "logprobs": logprobs,
        "versions": versions,
        "rewards": torch.tensor([reward], dtype=torch.float32),
        "is_truncated": torch.tensor([False]),
    }


def padded_batch(rows: int = 16, length: int = PROMPT_TOKENS + COMPLETION_TOKENS, seed: int = 0) -> dict[str, Tensor]:
    """A ``[rows, length]`` padded batch with every field (as the grouping tier emits)."""
    parts = [trajectory(length // 4, length - length // 4, seed + i) for i in range(rows)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def payload_bytes(tensors: dict[str, Tensor]) -> int:
    """The raw tensor bytes of a dict: the bytes every format must move at least."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def mixed_lengths(n: int, seed: int = 0, prompt: tuple[int, int] = (128, 512),
                  completion: tuple[int, int] = (256, 1536)) -> list[tuple[int, int]]:
    """``n`` (prompt, completion) lengths drawn uniformly from the given ranges."""
    rng = random.Random(seed)
    return [(rng.randint(*prompt), rng.randint(*completion)) for _ in range(n)]


def scored_episode(task_id: str, sample_idx: int, group_size: int, tensors: dict[str, Tensor],
                   reward: float = 1.0, head_version: int = 0) -> ScoredEpisode:
    """A ``ScoredEpisode`` as a reward worker writes it."""
    episode = Episode(
        task_id=task_id, sample_idx=sample_idx, group_size=group_size,
        trajectory=encode_tensor_dict(tensors), stop_reason="length",
        head_version=head_version, tail_version=head_version, has_reward=False,
        worker_id="bench", generated_at=time.time(),
    )
    return ScoredEpisode(episode=episode, reward=reward, scored_by="bench", scored_at=time.time())

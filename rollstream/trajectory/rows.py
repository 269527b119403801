"""What a trajectory row is: its keys and dtypes, how a row is built, how a dict is checked.

A trajectory dict holds ``[B, L]`` sequence tensors (:data:`SEQUENCE_KEYS`: ``input_ids``,
``attention_mask``, ``loss_mask``, ``logprobs``, ``versions``) and ``[B]`` per-row tensors
(:data:`ROW_KEYS`: ``rewards``, ``is_truncated``), with the dtypes of :data:`trajectory_dtypes`.
Rows are padded together by :mod:`rollstream.trajectory.padding`; which versions wrote them is
:mod:`rollstream.trajectory.staleness`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
import torch
from torch import Tensor

from rollstream.trajectory.staleness import PROMPT_VERSION

SEQUENCE_KEYS: tuple[str, ...] = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions")
ROW_KEYS: tuple[str, ...] = ("rewards", "is_truncated")
REQUIRED_KEYS: tuple[str, ...] = ("input_ids", "attention_mask")

trajectory_dtypes: dict[str, torch.dtype] = {
    "input_ids": torch.int32,
    "attention_mask": torch.bool,
    "loss_mask": torch.int32,
    "logprobs": torch.float32,
    "versions": torch.int32,
    "rewards": torch.float32,
    "is_truncated": torch.bool,
}


def _check_dtypes(td: dict[str, Tensor]) -> None:
    for key, dtype in trajectory_dtypes.items():
        if key not in td:
            continue
        if not isinstance(td[key], Tensor):
            raise ValueError(f"trajectory key {key!r} must be a tensor, got {type(td[key]).__name__}")
        if td[key].dtype != dtype:
            raise ValueError(f"trajectory key {key!r} must have dtype {dtype}, got {td[key].dtype}")


def _check_shapes(td: dict[str, Tensor]) -> None:
    ids = td["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {list(ids.shape)}")
    for key in SEQUENCE_KEYS:
        if key in td and td[key].shape != ids.shape:
            raise ValueError(
                f"{key} has shape {list(td[key].shape)}, expected {list(ids.shape)} like input_ids"
            )
    for key in ROW_KEYS:
        if key in td and tuple(td[key].shape) != (ids.shape[0],):
            raise ValueError(f"{key} has shape {list(td[key].shape)}, expected [{ids.shape[0]}]")


def validate_trajectory(td: dict[str, Tensor]) -> None:
    """Raise ``ValueError`` saying exactly what is wrong with a trajectory dict, else return.

    Checks: required keys (``input_ids``, ``attention_mask``) present; known keys have the
    dtypes of :data:`trajectory_dtypes`; sequence keys are all ``[B, L]``; ``rewards`` and
    ``is_truncated`` are ``[B]``; ``logprobs`` are finite. Unknown keys are not checked.
    """
    missing = [k for k in REQUIRED_KEYS if k not in td]
    if missing:
        raise ValueError(f"trajectory lacks required keys {missing}; has {sorted(td)}")
    _check_dtypes(td)
    _check_shapes(td)
    if "logprobs" in td and not _all_finite(td["logprobs"]):
        bad = (~torch.isfinite(td["logprobs"])).nonzero().tolist()
        raise ValueError(f"logprobs contain NaN or inf at [row, position] {bad[:5]}")
    if "rewards" in td and not bool(torch.isfinite(td["rewards"]).all()):
        raise ValueError("rewards contain NaN or inf")


def _all_finite(t: Tensor) -> bool:
    """``torch.isfinite(t).all()`` through a numpy view for a CPU tensor without grad: three
    torch dispatches cost ~3x numpy's two calls on a rollout worker's one-row tensors (a few %
    of the tier's CPU per episode for short episodes, bench/sizing.py profile)."""
    if t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad:
        return bool(numpy.isfinite(t.numpy()).all())
    return bool(torch.isfinite(t).all())


class TrajectoryBuilder:
    """Accumulates one sequence as prompt and output segments, then yields a ``[1, L]`` row.

    Prompt positions (the first prompt, and anything appended between turns) get loss_mask 0,
    logprob 0.0 and version -1; output positions get loss_mask 1 and the engine's values.

    Each segment is converted to numpy once and the row is concatenated at the end: only the
    token ids, logprobs and versions are converted from lists (the masks and the prompt's fill
    values are made by numpy), which halves the rollout worker's list conversions
    (bench/pipeline.py profiles; numpy converts lists about 3x faster than ``torch.tensor``).
    """

    def __init__(self) -> None:
        self._segments: dict[str, list[numpy.ndarray]] = {key: [] for key in _BUILDER_DTYPES}
        self._length = 0

    def add_prompt(self, ids: Sequence[int]) -> None:
        n = len(ids)
        self._append(
            input_ids=numpy.array(ids, dtype=numpy.int32), loss_mask=numpy.zeros(n, numpy.int32),
            logprobs=numpy.zeros(n, numpy.float32), versions=numpy.full(n, PROMPT_VERSION, numpy.int32),
        )

    def add_output(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        """Append generated tokens; ``ValueError`` unless there is one logprob and version each."""
        if not len(logprobs) == len(versions) == len(ids):
            raise ValueError(
                f"output has {len(ids)} tokens but {len(logprobs)} logprobs and "
                f"{len(versions)} versions; an engine must return one of each per token"
            )
        self._append(
            input_ids=numpy.array(ids, dtype=numpy.int32), loss_mask=numpy.ones(len(ids), numpy.int32),
            logprobs=numpy.array(logprobs, dtype=numpy.float32), versions=numpy.array(versions, dtype=numpy.int32),
        )

    def _append(self, **segment: numpy.ndarray) -> None:
        for key, values in segment.items():
            if values.ndim != 1:
                raise ValueError(f"{key} of a segment must be a flat sequence, got shape {values.shape}")
            self._segments[key].append(values)
        self._length += len(segment["input_ids"])

    def to_tensors(self, reward: float | None = None, is_truncated: bool | None = None) -> dict[str, Tensor]:
        """The ``[1, L]`` row; ``rewards`` / ``is_truncated`` ([1]) only when given."""
        row: dict[str, Tensor] = {
            key: torch.from_numpy(_joined(self._segments[key], dtype)).unsqueeze(0)
            for key, dtype in _BUILDER_DTYPES.items()
        }
        row["attention_mask"] = torch.ones((1, self._length), dtype=torch.bool)
        if reward is not None:
            row["rewards"] = torch.tensor([float(reward)], dtype=torch.float32)
        if is_truncated is not None:
            row["is_truncated"] = torch.tensor([bool(is_truncated)], dtype=torch.bool)
        return row


_BUILDER_DTYPES: dict[str, type] = {
    "input_ids": numpy.int32, "loss_mask": numpy.int32, "logprobs": numpy.float32, "versions": numpy.int32,
}


def _joined(segments: list[numpy.ndarray], dtype: type) -> numpy.ndarray:
    if not segments:
        return numpy.empty(0, dtype)
    return numpy.concatenate(segments) if len(segments) > 1 else segments[0]


def trajectory_row(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    output_logprobs: Sequence[float],
    output_versions: Sequence[int],
    reward: float | None = None,
    is_truncated: bool | None = None,
) -> dict[str, Tensor]:
    """One prompt and its output as a ``[1, L]`` row (see :class:`TrajectoryBuilder`)."""
    builder = TrajectoryBuilder()
    builder.add_prompt(prompt_ids)
    builder.add_output(output_ids, output_logprobs, output_versions)
    return builder.to_tensors(reward=reward, is_truncated=is_truncated)

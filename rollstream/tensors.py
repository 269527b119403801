"""Trajectory tensor dicts (torch): padding, concatenation, validation and row building.

A trajectory dict holds ``[B, L]`` sequence tensors (``input_ids``, ``attention_mask``,
``loss_mask``, ``logprobs``, ``versions``) and ``[B]`` per-row tensors (``rewards``,
``is_truncated``); see :data:`trajectory_dtypes`. The torch-free half (row spans, versions,
padding numpy arrays into a packed buffer) is :mod:`rollstream.arrays`, whose names this
module re-exports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy
import torch
from torch import Tensor

from rollstream.arrays import (
    PROMPT_VERSION,
    REQUIRED_KEYS,
    ROW_KEYS,
    SEQUENCE_KEYS,
    RowSpan,
    PRESENT_SUFFIX,
    align_keys,
    check_same_keys,
    concat_padded_arrays,
    pad_value_for,
    row_spans,
    span_range,
    version_span,
)
from rollstream.wire.packed import ArrayArena
from rollstream.wire.torch_tensors import DTYPE_NAMES, as_array, as_tensor, tensor_arena

__all__ = [
    "PRESENT_SUFFIX", "PROMPT_VERSION", "REQUIRED_KEYS", "ROW_KEYS", "SEQUENCE_KEYS", "RowSpan", "TrajectoryBuilder",
    "align_keys",
    "concat_padded_arena", "concat_padded_tensors", "row_spans", "span_range", "trajectory_dtypes",
    "trajectory_row", "validate_trajectory", "version_span",
]

trajectory_dtypes: dict[str, torch.dtype] = {
    "input_ids": torch.int32,
    "attention_mask": torch.bool,
    "loss_mask": torch.int32,
    "logprobs": torch.float32,
    "versions": torch.int32,
    "rewards": torch.float32,
    "is_truncated": torch.bool,
}


def _right_pad(t: Tensor, shape: Sequence[int], value: float) -> Tensor:
    """``t`` right-padded with ``value`` in every non-batch dim up to ``shape[1:]``."""
    if tuple(t.shape[1:]) == tuple(shape):
        return t
    # F.pad takes (left, right) pairs from the last dim backwards; one op, no index tuple
    pad: list[int] = []
    for have, want in zip(reversed(t.shape[1:]), reversed(shape)):
        pad += [0, want - have]
    return torch.nn.functional.pad(t, pad, value=value)


def _concat_key(key: str, values: list[Any], pad_value: float) -> Any:
    if not all(isinstance(v, Tensor) for v in values):
        if all(isinstance(v, list) for v in values):
            return [x for v in values for x in v]  # e.g. per-row multimodal inputs
        raise TypeError(f"cannot concatenate {key!r}: values must all be tensors or all be lists")
    ndims = {v.dim() for v in values}
    if len(ndims) != 1:
        raise ValueError(f"cannot concatenate {key!r}: tensors have different ranks {sorted(ndims)}")
    if ndims == {0}:
        return torch.stack(values)
    if ndims == {1}:
        return torch.cat(values, dim=0)
    shape = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
    fill = pad_value_for(key, pad_value)
    return torch.cat([_right_pad(v, shape, fill) for v in values], dim=0)


def concat_padded_tensors(dicts: list[dict[str, Tensor]], pad_value: float = 0.0) -> dict[str, Tensor]:
    """Concatenate trajectory dicts along the batch dim, right-padding to a common length.

    - no dicts -> ``{}``; one dict -> a shallow copy of it (not validated);
    - every dict must have the same key set, else ``ValueError`` naming the differing keys;
    - 0-dim tensors are stacked, 1-dim tensors concatenated on dim 0;
    - tensors with 2 or more dims are right-padded in every non-batch dim to the largest size
      and then concatenated on dim 0; lists are concatenated as lists.

    Padding values: ``attention_mask`` always pads with 0 (False). DECISION: ``versions`` pads
    with -1, the prompt version, not with ``pad_value`` (the reference pads with 0), so a padded
    position can never be mistaken for output of policy version 0. Every other key pads with
    ``pad_value``.
    """
    if not dicts:
        return {}
    if len(dicts) == 1:
        return dict(dicts[0])
    check_same_keys(dicts)
    return {k: _concat_key(k, [d[k] for d in dicts], pad_value) for k in dicts[0]}


def concat_padded_arena(dicts: list[dict[str, Tensor]], pad_value: float = 0.0) -> dict[str, Any]:
    """``concat_padded_tensors``' result (same values, dtypes, shapes, padding and errors) with
    every tensor written into ONE buffer, in key order, so that ``pack_tensor_dict`` sends them
    without a copy: :func:`rollstream.arrays.concat_padded_arrays` on the tensors' values
    (detached, on the CPU), handed back as tensors that share the buffer.

    Non-tensor values (lists) stay outside the buffer; one dict's tensors are copied into it
    as they are. ``TypeError`` for a dtype the wire does not carry.
    """
    arrays = [{k: _as_wire_array(k, v) for k, v in d.items()} for d in dicts]
    out = concat_padded_arrays(arrays, pad_value)
    if isinstance(out, ArrayArena):
        return tensor_arena(out)
    return {k: as_tensor(v) if isinstance(v, numpy.ndarray) else v for k, v in out.items()}


def _as_wire_array(key: str, value: Any) -> Any:
    """A tensor's values as an array (bfloat16: words); anything else as it is."""
    if not isinstance(value, Tensor):
        return value
    if value.dtype not in DTYPE_NAMES:  # e.g. torch.uint16, which numpy would call bfloat16 words
        raise TypeError(f"unsupported tensor dtype on the wire: {key!r} is {value.dtype}")
    return as_array(value)


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
    if "logprobs" in td and not bool(torch.isfinite(td["logprobs"]).all()):
        bad = (~torch.isfinite(td["logprobs"])).nonzero().tolist()
        raise ValueError(f"logprobs contain NaN or inf at [row, position] {bad[:5]}")
    if "rewards" in td and not bool(torch.isfinite(td["rewards"]).all()):
        raise ValueError("rewards contain NaN or inf")


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

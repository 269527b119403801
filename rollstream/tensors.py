"""Trajectory tensor dicts: padding, concatenation, validation and row building.

A trajectory dict holds ``[B, L]`` sequence tensors (``input_ids``, ``attention_mask``,
``loss_mask``, ``logprobs``, ``versions``) and ``[B]`` per-row tensors (``rewards``,
``is_truncated``); see :data:`trajectory_dtypes`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy
import torch
from torch import Tensor

from rollstream.wire.packed import allocate_packed

log = logging.getLogger(__name__)

trajectory_dtypes: dict[str, torch.dtype] = {
    "input_ids": torch.int32,
    "attention_mask": torch.bool,
    "loss_mask": torch.int32,
    "logprobs": torch.float32,
    "versions": torch.int32,
    "rewards": torch.float32,
    "is_truncated": torch.bool,
}
SEQUENCE_KEYS: tuple[str, ...] = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions")
ROW_KEYS: tuple[str, ...] = ("rewards", "is_truncated")
REQUIRED_KEYS: tuple[str, ...] = ("input_ids", "attention_mask")
PROMPT_VERSION = -1  # version of prompt positions, and of padding (see concat_padded_tensors)


def version_span(versions: Tensor | None, mask: numpy.ndarray | None = None) -> tuple[int, int]:
    """``(head, tail)``: min and max of ``versions`` over generated tokens (``>= 0``, and where
    ``mask`` is true when given); ``(-1, -1)`` when there is none."""
    if versions is None or versions.numel() == 0:
        return PROMPT_VERSION, PROMPT_VERSION
    # numpy, not torch: torch's boolean indexing runs nonzero on its intra-op thread pool
    # (over a millisecond per group on a busy 2-core machine, bench/grouping.py), and each
    # small torch op costs more in dispatch than its work.
    values = versions.detach().cpu().numpy()
    keep = values >= 0
    if mask is not None:
        keep &= mask.astype(bool, copy=False)
    if not keep.any():
        return PROMPT_VERSION, PROMPT_VERSION
    generated = values[keep]
    return int(generated.min()), int(generated.max())


class RowSpan(NamedTuple):
    """Where a row's answer lies and which policy versions wrote it (see :func:`row_spans`)."""

    seqlen: int  # attended positions (padding excluded)
    prompt_len: int  # attended positions before the first generated one; seqlen when none
    head_version: int  # oldest known version over generated positions; -1 when none generated
    tail_version: int  # newest


def row_spans(td: Mapping[str, Tensor], fallback_version: int = PROMPT_VERSION) -> list[RowSpan]:
    """The :class:`RowSpan` of every row of a ``[B, L]`` trajectory dict: THE computation of
    ``seqlen``, ``prompt_len`` and head/tail versions, shared by the episode message (its
    ``head_version``/``tail_version``), the trajectory dumps and the replay filters.

    - Attended positions: ``attention_mask != 0`` (every position without an attention mask);
      everything below counts attended positions only.
    - Generated positions: ``loss_mask == 1``; without a loss mask, the positions whose
      version is ``>= 0`` (prompts carry -1 by contract); without either nothing tells prompt
      from answer and the whole row counts as prompt.
    - ``prompt_len``: the index of the first generated position (the reference's
      ``seqlen - sum(loss_mask)`` is wrong for multi-turn rows).
    - Versions: min and max of ``versions`` over generated positions, leaving out ``-1`` (a
      token of unknown version). When generated positions exist (or cannot be told) but no
      version is known, e.g. without a ``versions`` tensor, both are ``fallback_version``: the
      reference's fallback, the engine's version when the episode ended. A row with no
      generated position gets ``(-1, -1)``.
    """
    rows, length = td["input_ids"].shape[:2]
    attended = _bool_rows(td.get("attention_mask"), rows, length)
    loss = _int_rows(td.get("loss_mask"))
    versions = _int_rows(td.get("versions"))
    return [
        _row_span(
            attended[r], None if loss is None else loss[r], None if versions is None else versions[r],
            fallback_version,
        )
        for r in range(rows)
    ]


def span_range(spans: Sequence[RowSpan]) -> tuple[int, int]:
    """``(head, tail)`` of several rows: the oldest head and the newest tail; -1 when none."""
    heads = [s.head_version for s in spans if s.head_version >= 0]
    tails = [s.tail_version for s in spans if s.tail_version >= 0]
    return (min(heads) if heads else PROMPT_VERSION, max(tails) if tails else PROMPT_VERSION)


def _row_span(
    attended: numpy.ndarray, loss: numpy.ndarray | None, versions: numpy.ndarray | None, fallback: int
) -> RowSpan:
    seqlen = int(attended.sum())
    if loss is not None:
        generated: numpy.ndarray | None = loss[attended] == 1
    elif versions is not None:
        generated = versions[attended] >= 0
    else:
        generated = None  # nothing tells prompt from answer
    if generated is None:
        return RowSpan(seqlen, seqlen, fallback, fallback)
    where = numpy.flatnonzero(generated)
    if where.size == 0:
        return RowSpan(seqlen, seqlen, PROMPT_VERSION, PROMPT_VERSION)
    known = versions[attended][generated] if versions is not None else where[:0]
    known = known[known >= 0]
    if known.size == 0:
        return RowSpan(seqlen, int(where[0]), fallback, fallback)
    return RowSpan(seqlen, int(where[0]), int(known.min()), int(known.max()))


def _as_array(t: Tensor) -> numpy.ndarray:
    # numpy, not torch: see version_span
    return t.detach().cpu().numpy()


def _bool_rows(mask: Tensor | None, rows: int, length: int) -> numpy.ndarray:
    if mask is None:
        return numpy.ones((rows, length), dtype=bool)
    return _as_array(mask).astype(bool, copy=False)


def _int_rows(t: Tensor | None) -> numpy.ndarray | None:
    return None if t is None else _as_array(t)


def _pad_value_for(key: str, pad_value: float) -> float:
    if key == "attention_mask":
        return 0
    if key == "versions":
        return PROMPT_VERSION
    return pad_value


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
    fill = _pad_value_for(key, pad_value)
    return torch.cat([_right_pad(v, shape, fill) for v in values], dim=0)


def _check_same_keys(dicts: list[dict[str, Any]]) -> None:
    keys = set(dicts[0])
    for i, d in enumerate(dicts[1:], start=1):
        if set(d) != keys:
            missing, extra = sorted(keys - set(d)), sorted(set(d) - keys)
            raise ValueError(
                f"cannot concatenate tensor dicts with different keys: dict {i} lacks {missing} "
                f"and has extra {extra} compared with dict 0"
            )


def common_keys(parts: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
    """Keep only keys every trajectory has (an optional key missing in one would fail the concat).

    The keys dropped are logged as a warning, never silently."""
    common = set(parts[0]).intersection(*parts[1:])
    extra = set().union(*parts) - common
    if extra:
        log.warning("dropping trajectory keys %s that not every episode of the batch has", sorted(extra))
    return [{k: v for k, v in p.items() if k in common} for p in parts]


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
    _check_same_keys(dicts)
    return {k: _concat_key(k, [d[k] for d in dicts], pad_value) for k in dicts[0]}


class _Planned:
    """One key's tensor in the arena: its dtype and shape, and how its parts fill it."""

    def __init__(self, key: str, parts: list[Tensor], pad_value: float) -> None:
        self.parts = parts
        self.fill = _pad_value_for(key, pad_value)
        if len(parts) == 1:  # one dict: the tensor as it is, like concat_padded_tensors
            self.ndim, self.dtype, self.shape = -1, parts[0].dtype, list(parts[0].shape)
            return
        dtypes = {p.dtype for p in parts}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else functools.reduce(torch.promote_types, dtypes)
        self.ndim = parts[0].dim()
        if self.ndim == 0:
            self.shape = [len(parts)]
            return
        self.shape = [sum(p.shape[0] for p in parts)]
        self.shape += [max(p.shape[d] for p in parts) for d in range(1, self.ndim)]

    def write(self, out: Tensor) -> None:
        """Fill ``out`` (call under ``torch.no_grad()``): a copy of the one part, the parts
        stacked (0-dim) or concatenated (1-dim), or their rows right-padded (2+ dims)."""
        if self.ndim == -1:
            out.copy_(self.parts[0])
        elif self.ndim == 0:
            torch.stack(self.parts, out=out)
        elif self.ndim == 1:
            torch.cat(self.parts, out=out)
        else:
            self._write_rows(out)

    def _write_rows(self, out: Tensor) -> None:
        target, parts = _as_arrays(out, self.parts)
        if any(tuple(p.shape[1:]) != tuple(self.shape[1:]) for p in parts):
            target[...] = self.fill
        row = 0
        for part in parts:
            rows = part.shape[0]
            target[(slice(row, row + rows), *(slice(0, n) for n in part.shape[1:]))] = part
            row += rows


def _as_arrays(out: Tensor, parts: list[Tensor]) -> tuple[Any, list[Any]]:
    """numpy views of ``out`` and ``parts`` when all have them (a slice assignment costs a
    fraction of torch's, and a padded batch takes one per row and key), else the tensors."""
    try:
        return out.numpy(), [p.numpy() for p in parts]
    except (TypeError, RuntimeError):  # bfloat16, GPU, grad, conj/neg views
        return out, parts


def _plan_key(key: str, values: list[Any], pad_value: float) -> _Planned | Any:
    """How ``key`` is concatenated (same rules and errors as ``concat_padded_tensors``); a
    non-tensor result (lists, or one dict's value) is returned as it is."""
    if len(values) == 1 and not isinstance(values[0], Tensor):
        return values[0]
    if not all(isinstance(v, Tensor) for v in values):
        if all(isinstance(v, list) for v in values):
            return [x for v in values for x in v]
        raise TypeError(f"cannot concatenate {key!r}: values must all be tensors or all be lists")
    ndims = {v.dim() for v in values}
    if len(ndims) != 1:
        raise ValueError(f"cannot concatenate {key!r}: tensors have different ranks {sorted(ndims)}")
    return _Planned(key, values, pad_value)


def concat_padded_arena(dicts: list[dict[str, Tensor]], pad_value: float = 0.0) -> dict[str, Any]:
    """``concat_padded_tensors``' result (same values, dtypes, shapes, padding and errors) with
    every tensor written into ONE buffer, in key order (``rollstream.wire.allocate_packed``),
    so that ``pack_tensor_dict`` sends them without a copy: the grouping tier's batches.

    Non-tensor values (lists) stay outside the buffer; one dict's tensors are copied into it
    as they are. ``TypeError`` for a dtype the wire does not carry.
    """
    if not dicts:
        return {}
    if len(dicts) > 1:
        _check_same_keys(dicts)
    plans = {k: _plan_key(k, [d[k] for d in dicts], pad_value) for k in dicts[0]}
    arena = allocate_packed([(k, p.dtype, p.shape) for k, p in plans.items() if isinstance(p, _Planned)])
    with torch.no_grad():  # out= and in-place writes refuse inputs that require grad otherwise
        for key, tensor in arena.items():
            plans[key].write(tensor)
    return {k: arena.get(k, plan) for k, plan in plans.items()}


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

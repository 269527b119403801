"""Trajectory dicts as numpy arrays: row spans, versions, and padding into one packed buffer.

The numpy half of the trajectory helpers, for the tiers that run no model and never import
torch (the grouping tier pads its batches with :func:`concat_padded_arrays`, the dump tier
reads row spans). :mod:`rollstream.tensors` is the torch half (validation, row building,
``concat_padded_tensors``) and re-exports these names; the span functions accept torch
tensors too.

A trajectory dict holds ``[B, L]`` sequence tensors (:data:`SEQUENCE_KEYS`) and ``[B]`` per-row
tensors (:data:`ROW_KEYS`). In arrays, bfloat16 is ``uint16`` words
(:mod:`rollstream.wire.dtypes`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy

from rollstream.wire.dtypes import NUMPY_DTYPES, cast, fill_value, promote_all, wire_name
from rollstream.wire.packed import allocate_arrays

log = logging.getLogger(__name__)

SEQUENCE_KEYS: tuple[str, ...] = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions")
ROW_KEYS: tuple[str, ...] = ("rewards", "is_truncated")
REQUIRED_KEYS: tuple[str, ...] = ("input_ids", "attention_mask")
PROMPT_VERSION = -1  # version of prompt positions, and of padding (see pad_value_for)


def _as_array(values: Any) -> numpy.ndarray:
    """``values`` as a numpy array: an array as it is, a torch tensor's integer or boolean
    values (detached, on the CPU) without importing torch here."""
    if isinstance(values, numpy.ndarray):
        return values
    return values.detach().cpu().numpy()


def version_span(versions: Any | None, mask: numpy.ndarray | None = None) -> tuple[int, int]:
    """``(head, tail)``: min and max of ``versions`` (an array or a tensor) over generated tokens
    (``>= 0``, and where ``mask`` is true when given); ``(-1, -1)`` when there is none."""
    if versions is None:
        return PROMPT_VERSION, PROMPT_VERSION
    # numpy, not torch: torch's boolean indexing runs nonzero on its intra-op thread pool
    # (over a millisecond per group on a busy 2-core machine, bench/grouping.py), and each
    # small torch op costs more in dispatch than its work.
    values = _as_array(versions)
    if values.size == 0:
        return PROMPT_VERSION, PROMPT_VERSION
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


def row_spans(td: Mapping[str, Any], fallback_version: int = PROMPT_VERSION) -> list[RowSpan]:
    """The :class:`RowSpan` of every row of a ``[B, L]`` trajectory dict (arrays or tensors):
    THE computation of ``seqlen``, ``prompt_len`` and head/tail versions, shared by the episode
    message (its ``head_version``/``tail_version``), the trajectory dumps and the replay filters.

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


def _bool_rows(mask: Any | None, rows: int, length: int) -> numpy.ndarray:
    if mask is None:
        return numpy.ones((rows, length), dtype=bool)
    return _as_array(mask).astype(bool, copy=False)


def _int_rows(values: Any | None) -> numpy.ndarray | None:
    return None if values is None else _as_array(values)


def pad_value_for(key: str, pad_value: float) -> float:
    """What ``key`` pads with: ``attention_mask`` 0 (False); ``versions`` -1, the prompt
    version, never ``pad_value`` (DECISION: a padded position can never be mistaken for output
    of policy version 0; the reference pads with 0); every other key ``pad_value``."""
    if key == "attention_mask":
        return 0
    if key == "versions":
        return PROMPT_VERSION
    return pad_value


def check_same_keys(dicts: Sequence[Mapping[str, Any]]) -> None:
    keys = set(dicts[0])
    for i, d in enumerate(dicts[1:], start=1):
        if set(d) != keys:
            missing, extra = sorted(keys - set(d)), sorted(set(d) - keys)
            raise ValueError(
                f"cannot concatenate tensor dicts with different keys: dict {i} lacks {missing} "
                f"and has extra {extra} compared with dict 0"
            )


PRESENT_SUFFIX = "_present"  # ``<key>_present``: [B] bool, True on the rows that had ``<key>``


def align_keys(parts: list[dict[str, Any]], pad_value: float = 0.0) -> list[dict[str, Any]]:
    """Give every trajectory the keys of all of them, so that none is lost when trajectories
    of different workflows meet in one batch (or one trainer step).

    A key some parts lack is kept: those parts get it filled with the value padding gets
    (:func:`pad_value_for`: ``versions`` -1, ``attention_mask`` 0, the rest ``pad_value``;
    ``is_truncated`` reads False), shaped as the first part that has it with their own row
    count, and every part gets ``<key>_present`` (:data:`PRESENT_SUFFIX`): ``[B]`` bool, True on
    the rows whose episode had the key. A part that already carries ``<key>_present`` (a batch
    aligned before) keeps its own, so aligning batches of aligned batches says the same.
    Parts that agree on their keys are returned unchanged (no mask is added). Works on numpy
    arrays and torch tensors alike; the result has every key in the same order in each part.
    """
    order = list(dict.fromkeys(k for part in parts for k in part))
    masks = {k + PRESENT_SUFFIX for k in order} & set(order)
    data = [k for k in order if k not in masks]
    ragged = [k for k in data if any(k not in part or k + PRESENT_SUFFIX in part for part in parts)]
    if not ragged:
        return parts
    aligned = [dict(part) for part in parts]
    for key in ragged:
        donor = next(part[key] for part in parts if key in part)
        for part, out in zip(parts, aligned):
            rows = _rows(part)
            present = part.get(key + PRESENT_SUFFIX)
            if key not in part:
                out[key] = _filled(donor, rows, pad_value_for(key, pad_value))
                present = _mask(donor, rows, False)
            elif present is None:
                present = _mask(donor, rows, True)
            out[key + PRESENT_SUFFIX] = present
    final = data + [k + PRESENT_SUFFIX for k in data if k in ragged or k + PRESENT_SUFFIX in masks]
    final += [k for k in order if k in masks and k not in final]
    return [{k: out[k] for k in final if k in out} for out in aligned]


def _rows(part: Mapping[str, Any]) -> int:
    ids = part.get("input_ids")
    if ids is None:
        ids = next(v for v in part.values() if getattr(v, "ndim", 0) > 0)
    return int(ids.shape[0])


def _filled(donor: Any, rows: int, value: float) -> Any:
    """``rows`` rows shaped as ``donor``'s rows (a 0-dim donor: one value), all ``value``."""
    shape = tuple(donor.shape[1:]) if donor.ndim else ()
    shape = (rows, *shape) if donor.ndim else shape
    if isinstance(donor, numpy.ndarray):
        return numpy.full(shape, fill_value(value, _wire_name("fill", donor)), dtype=donor.dtype)
    return donor.new_full(shape, value)  # a torch tensor: its dtype and device


def _mask(donor: Any, rows: int, value: bool) -> Any:
    if isinstance(donor, numpy.ndarray):
        return numpy.full((rows,), value, dtype=bool)
    return (donor.new_ones((rows,)) if value else donor.new_zeros((rows,))).bool()


class _Planned:
    """One key's array in the arena: its wire dtype and shape, and how its parts fill it."""

    def __init__(self, key: str, parts: list[numpy.ndarray], pad_value: float) -> None:
        self.parts = parts
        self.names = [_wire_name(key, p) for p in parts]
        if len(parts) == 1:  # one dict: the array as it is, like concat_padded_tensors
            self.ndim, self.name, self.shape = -1, self.names[0], list(parts[0].shape)
        else:
            self.name = promote_all(set(self.names))
            self.ndim = parts[0].ndim
            if self.ndim == 0:
                self.shape = [len(parts)]
            else:
                self.shape = [sum(p.shape[0] for p in parts)]
                self.shape += [max(p.shape[d] for p in parts) for d in range(1, self.ndim)]
        self.pad = pad_value_for(key, pad_value)

    def write(self, out: numpy.ndarray) -> None:
        """Fill ``out``: a copy of the one part, the parts (converted to the promoted dtype)
        stacked (0-dim) or concatenated (1-dim), or their rows right-padded (2+ dims)."""
        parts = [cast(p, n, self.name) for p, n in zip(self.parts, self.names)]
        if self.ndim == -1:
            out[...] = parts[0]
        elif self.ndim == 0:
            numpy.stack(parts, out=out)
        elif self.ndim == 1:
            numpy.concatenate(parts, out=out)
        else:
            self._write_rows(out, parts)

    def _write_rows(self, out: numpy.ndarray, parts: list[numpy.ndarray]) -> None:
        full = tuple(self.shape[1:])
        if any(name != self.name for name in self.names):
            self._pad_each(out, parts)
        elif any(p.shape[1:] != full for p in parts):
            out[...] = fill_value(self.pad, self.name)  # one fill: cheaper than one per part
        row = 0
        for part in parts:
            rows = part.shape[0]
            out[(slice(row, row + rows), *(slice(0, n) for n in part.shape[1:]))] = part
            row += rows

    def _pad_each(self, out: numpy.ndarray, parts: list[numpy.ndarray]) -> None:
        """Parts of different dtypes: each part's rows get the pad value as its own dtype holds
        it, then converted (torch pads each part before concatenating: an int32 part pads -2.5
        as -2, even where the batch is float32)."""
        row = 0
        for part, name in zip(parts, self.names):
            if part.shape[1:] != tuple(self.shape[1:]):
                own = numpy.asarray(fill_value(self.pad, name)).astype(NUMPY_DTYPES[name])
                out[row : row + part.shape[0]] = cast(own, name, self.name)
            row += part.shape[0]


def _wire_name(key: str, part: numpy.ndarray) -> str:
    name = wire_name(part.dtype)
    if name is None:
        raise TypeError(f"unsupported tensor dtype on the wire: {key!r} is {part.dtype}")
    return name


def _plan_key(key: str, values: list[Any], pad_value: float) -> _Planned | Any:
    """How ``key`` is concatenated; a non-array result (lists, or one dict's value) is
    returned as it is."""
    if len(values) == 1 and not isinstance(values[0], numpy.ndarray):
        return values[0]
    if not all(isinstance(v, numpy.ndarray) for v in values):
        if all(isinstance(v, list) for v in values):
            return [x for v in values for x in v]  # e.g. per-row multimodal inputs
        raise TypeError(f"cannot concatenate {key!r}: values must all be tensors or all be lists")
    ndims = {v.ndim for v in values}
    if len(ndims) != 1:
        raise ValueError(f"cannot concatenate {key!r}: tensors have different ranks {sorted(ndims)}")
    return _Planned(key, values, pad_value)


def concat_padded_arrays(dicts: list[dict[str, Any]], pad_value: float = 0.0) -> dict[str, Any]:
    """Concatenate trajectory dicts of arrays along the batch dim, right-padding to a common
    length, into ONE buffer in key order (:func:`rollstream.wire.allocate_arrays`), so that
    ``pack_arrays`` sends them without a copy: the grouping tier's batches.

    The rules of ``rollstream.tensors.concat_padded_tensors``, with the same results (values,
    dtypes as torch promotes them, shapes) and errors:

    - no dicts -> ``{}``; one dict -> its arrays copied into the buffer as they are;
    - every dict must have the same key set, else ``ValueError`` naming the differing keys;
    - 0-dim arrays are stacked, 1-dim arrays concatenated on dim 0;
    - arrays with 2 or more dims are right-padded in every non-batch dim to the largest size
      (with :func:`pad_value_for`) and then concatenated on dim 0;
    - lists are concatenated as lists and stay outside the buffer (then the result is a plain
      dict, which ``pack_arrays`` refuses); ``TypeError`` for a dtype the wire does not carry.
    """
    if not dicts:
        return {}
    if len(dicts) > 1:
        check_same_keys(dicts)
    plans = {k: _plan_key(k, [d[k] for d in dicts], pad_value) for k in dicts[0]}
    arena = allocate_arrays([(k, p.name, p.shape) for k, p in plans.items() if isinstance(p, _Planned)])
    for key, array in arena.items():
        plans[key].write(array)
    if len(arena) == len(plans):
        return arena  # packs without a copy
    return {k: arena.get(k, plan) for k, plan in plans.items()}

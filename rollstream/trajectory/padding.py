"""THE padding of trajectory dicts: concatenate along the batch dim, right-padding to a common
shape, into one buffer in the packed wire layout.

One implementation, in numpy (:func:`concat_padded_arrays`), so the tiers that run no model
(grouping, dump) pad without torch. :func:`concat_padded_tensors`, AReaL's
function, is the same padding handed back as torch tensors that are views of the numpy
result: nothing is padded twice, and both send without a copy. This module imports torch only
inside :func:`concat_padded_tensors`, for its torch callers.

Rules (what callers may rely on):

- no dicts -> ``{}``; one dict -> its arrays copied as they are (no key check);
- every dict must have the same key set, else ``ValueError`` naming the differing keys
  (:func:`align_keys` first gives differing dicts the same keys);
- 0-dim values are stacked, 1-dim values concatenated on dim 0; values with 2 or more dims are
  right-padded in every non-batch dim to the largest size, then concatenated on dim 0;
- pad values (:func:`pad_value_for`): ``attention_mask`` 0 (False), ``versions`` -1 (the prompt
  version: a padded position is never output of version 0), every other key ``pad_value``,
  converted to the result's dtype (as ``Tensor.to`` converts: -2.5 into an integer key is -2;
  a value the dtype cannot hold, such as -1 into ``uint8``, is a ``ValueError``);
- dtypes: parts of one key that differ promote by torch's rules (``torch.promote_types``);
  ``TypeError`` for a dtype the wire does not carry (:data:`rollstream.wire.dtypes.WIRE_DTYPES`);
- lists are concatenated as lists (e.g. per-row multimodal inputs) and stay outside the buffer;
  a key whose values are neither all arrays nor all lists is a ``TypeError``; values of one key
  with different ranks are a ``ValueError``.

In arrays, bfloat16 is ``uint16`` words (:mod:`rollstream.wire.dtypes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy

from rollstream.trajectory.staleness import PROMPT_VERSION
from rollstream.wire.dtypes import cast, fill_value, promote_all, wire_name
from rollstream.wire.packed import allocate_arrays

if TYPE_CHECKING:
    from torch import Tensor

PRESENT_SUFFIX = "_present"  # ``<key>_present``: [B] bool, True on the rows that had ``<key>``


def pad_value_for(key: str, pad_value: float) -> float:
    """What ``key`` pads with: ``attention_mask`` 0 (False); ``versions`` -1, the prompt
    version, never ``pad_value`` (DECISION: a padded position can never be mistaken for output
    of policy version 0; AReaL pads with 0); every other key ``pad_value``."""
    if key == "attention_mask":
        return 0
    if key == "versions":
        return PROMPT_VERSION
    return pad_value


def concat_padded_arrays(dicts: Sequence[Mapping[str, Any]], pad_value: float = 0.0) -> dict[str, Any]:
    """Pad numpy trajectory dicts into ONE buffer (the rules of the module docstring).

    The result is an :class:`~rollstream.wire.packed.ArrayArena` (``pack_arrays`` sends it
    without a copy) whose arrays are fresh and writable; with list values, a plain dict of
    the arena's arrays and the lists.
    """
    if not dicts:
        return {}
    if len(dicts) > 1:
        _check_same_keys(dicts)
    plans = {k: _plan_key(k, [d[k] for d in dicts], pad_value) for k in dicts[0]}
    arena = allocate_arrays([(k, p.name, p.shape) for k, p in plans.items() if isinstance(p, _Planned)])
    for key, array in arena.items():
        plans[key].write(array)
    if len(arena) == len(plans):
        return arena  # packs without a copy
    return {k: arena.get(k, plan) for k, plan in plans.items()}


def concat_padded_tensors(dicts: Sequence[Mapping[str, Any]], pad_value: float = 0.0) -> dict[str, Tensor]:
    """AReaL's ``concat_padded_tensors``: :func:`concat_padded_arrays` on the
    tensors' values (read without a copy from CPU tensors), handed back as tensors that view
    its one buffer (no copy back; ``pack_tensor_dict`` sends them without a copy either).

    The result is always fresh, writable CPU memory that shares nothing with the inputs.
    Tensors on a GPU are read back to the CPU, and tensors that require grad are detached:
    the result is on the CPU and requires no grad (move it with ``.to(device)``). bfloat16
    stays ``torch.bfloat16``. ``TypeError`` for a dtype the wire does not carry (complex,
    ``torch.uint16``...).
    """
    from rollstream.wire.torch_tensors import as_array_dict, as_tensor_dict  # torch: its callers have it

    return as_tensor_dict(concat_padded_arrays([as_array_dict(d) for d in dicts], pad_value))


def align_keys(parts: list[dict[str, Any]], pad_value: float = 0.0) -> list[dict[str, Any]]:
    """Give every trajectory the keys of all of them, so that none is lost when trajectories
    of different workflows meet in one group (or one trainer step).

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


def _check_same_keys(dicts: Sequence[Mapping[str, Any]]) -> None:
    keys = set(dicts[0])
    for i, d in enumerate(dicts[1:], start=1):
        if set(d) != keys:
            missing, extra = sorted(keys - set(d)), sorted(set(d) - keys)
            raise ValueError(
                f"cannot concatenate tensor dicts with different keys: dict {i} lacks {missing} "
                f"and has extra {extra} compared with dict 0"
            )


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
    """One key's array in the buffer: its wire dtype and shape, and how its parts fill it."""

    def __init__(self, key: str, parts: list[numpy.ndarray], pad_value: float) -> None:
        self.parts, self.pad = parts, pad_value_for(key, pad_value)
        first = parts[0]
        # per-part dtypes only when they differ (rare): one lookup for the common case
        self.names = None if all(p.dtype == first.dtype for p in parts) else [_wire_name(key, p) for p in parts]
        self.name = _wire_name(key, first) if self.names is None else promote_all(set(self.names))
        self.ndim = first.ndim
        if len(parts) == 1:  # one dict: the array as it is (a 0-dim value stays 0-dim)
            self.shape = list(first.shape)
        elif self.ndim == 0:
            self.shape = [len(parts)]
        else:
            self.shape = [sum(p.shape[0] for p in parts)]
            self.shape += [max(p.shape[d] for p in parts) for d in range(1, self.ndim)]

    def write(self, out: numpy.ndarray) -> None:
        """Fill ``out``: a copy of the one part, the parts (converted to the promoted dtype)
        stacked (0-dim) or concatenated (1-dim), or their rows right-padded (2+ dims)."""
        parts = self.parts if self.names is None else [cast(p, n, self.name) for p, n in zip(self.parts, self.names)]
        if len(parts) == 1:
            out[...] = parts[0]
        elif self.ndim == 0:
            numpy.stack(parts, out=out)
        elif self.ndim == 1:
            numpy.concatenate(parts, out=out)
        else:
            self._write_rows(out, parts)

    def _write_rows(self, out: numpy.ndarray, parts: list[numpy.ndarray]) -> None:
        if any(p.shape[1:] != out.shape[1:] for p in parts):
            out[...] = fill_value(self.pad, self.name)  # one fill of the whole array: cheaper than one per part
        row = 0
        for part in parts:
            rows = part.shape[0]
            if self.ndim == 2:  # [B, L], nearly every key: a plain slice is cheaper to index with
                out[row : row + rows, : part.shape[1]] = part
            else:
                out[(slice(row, row + rows), *map(slice, part.shape[1:]))] = part
            row += rows


def _wire_name(key: str, part: numpy.ndarray) -> str:
    name = wire_name(part.dtype)
    if name is None:
        raise TypeError(f"unsupported tensor dtype on the wire: {key!r} is {part.dtype}")
    return name


def _plan_key(key: str, values: list[Any], pad_value: float) -> _Planned | Any:
    """How ``key`` is concatenated: a plan for arrays, a new list for lists; one dict's
    value of another type is returned as it is."""
    if not all(isinstance(v, numpy.ndarray) for v in values):
        if all(isinstance(v, list) for v in values):
            return [x for v in values for x in v]  # e.g. per-row multimodal inputs
        if len(values) == 1:
            return values[0]
        raise TypeError(f"cannot concatenate {key!r}: values must all be tensors or all be lists")
    ndims = {v.ndim for v in values}
    if len(ndims) != 1:
        raise ValueError(f"cannot concatenate {key!r}: tensors have different ranks {sorted(ndims)}")
    return _Planned(key, values, pad_value)

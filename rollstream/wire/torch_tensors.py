"""The wire's tensors as torch tensors: for the tiers and trainers that run a model.

The wire layer is numpy (``tensor_codec``, ``packed``, ``codec``); this module is its torch
face, and the only wire module that imports torch. The tiers that run no model (producer,
grouping, dump) never import it. Same contracts as the numpy functions: encoding describes a
tensor's memory without copying it (CPU, contiguous), decoding returns tensors that share the
message buffer (read-only: clone before writing in place); bfloat16 is a real
``torch.bfloat16`` here.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from rollstream.wire.dtypes import BFLOAT16_WORDS, ITEMSIZES, NUMPY_DTYPES, WIRE_DTYPES
from rollstream.wire.codec import group_arrays
from rollstream.wire.messages import EmittedGroup
from rollstream.wire.packed import ArrayArena, ArraySpec, PackedTensors, allocate_arrays, pack_copy, unpack_arrays
from rollstream.wire.tensor_codec import WireTensor, decode_array

# torch warns when wrapping an immutable buffer; sharing the message buffer is the point.
warnings.filterwarnings("ignore", message="The given buffer is not writable")
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in WIRE_DTYPES}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
TensorSpec = tuple[str, torch.dtype, Sequence[int]]
_TORCH: dict[numpy.dtype, torch.dtype] = {NUMPY_DTYPES[name]: dtype for name, dtype in DTYPES.items()}  # uint16: bfloat16

__all__ = [
    "DTYPES", "DTYPE_NAMES", "TensorSpec", "allocate_packed", "as_array", "as_array_dict", "as_tensor", "as_tensor_dict",
    "group_tensors",
    "decode_tensor", "decode_tensor_dict", "encode_tensor", "encode_tensor_dict", "pack_tensor_dict", "raw_bytes",
    "tensor_arena", "unpack_tensor_dict",
]


def as_tensor(array: numpy.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory; ``uint16`` arrays are bfloat16 words."""
    if array.size == 0:  # a fresh empty tensor: from_numpy gives empty ones odd strides
        return torch.empty(array.shape, dtype=_TORCH[array.dtype])
    if array.dtype == BFLOAT16_WORDS:
        return torch.from_numpy(array.view(numpy.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def as_array(tensor: torch.Tensor) -> numpy.ndarray:
    """``tensor``'s values as a numpy array (bfloat16: ``uint16`` words): a view of a CPU
    tensor's memory; detached, moved to the CPU, conjugation and negation resolved otherwise."""
    try:
        return tensor.numpy()  # raises for grad/GPU/bfloat16/conj views
    except (TypeError, RuntimeError):
        flat = tensor.detach().cpu().resolve_conj().resolve_neg()
        if flat.dtype == torch.bfloat16:
            return flat.view(torch.int16).numpy().view(BFLOAT16_WORDS)
        return flat.numpy()


def as_array_dict(values: Mapping[str, Any]) -> dict[str, Any]:
    """Each tensor of ``values`` as :func:`as_array` gives it; other values as they are.
    ``TypeError`` for a dtype the wire does not carry (numpy would take ``torch.uint16`` for
    bfloat16 words)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            array = as_array(value)
            if array.dtype == BFLOAT16_WORDS and value.dtype != torch.bfloat16:
                raise TypeError(f"unsupported tensor dtype on the wire: {key!r} is {value.dtype}")
            value = array  # any other dtype the wire does not carry is refused by its wire name
        out[key] = value
    return out


def as_tensor_dict(values: Mapping[str, Any]) -> dict[str, Any]:
    """Each array of ``values`` as a tensor sharing its memory (an ``ArrayArena``: views of its
    one buffer, which ``pack_tensor_dict`` packs without a copy); other values as they are."""
    if isinstance(values, ArrayArena):
        return tensor_arena(values)
    return {k: as_tensor(v) if isinstance(v, numpy.ndarray) else v for k, v in values.items()}


def _wire_name(key: str, dtype: torch.dtype) -> str:
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise TypeError(f"unsupported tensor dtype on the wire: {key!r} is {dtype}")
    return name


def encode_tensor(tensor: torch.Tensor) -> WireTensor:
    """Describe ``tensor`` for the wire without copying its memory (CPU tensors)."""
    name = DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise TypeError(f"unsupported tensor dtype on the wire: {tensor.dtype}")
    return WireTensor(name, list(tensor.shape), raw_bytes(tensor))


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of ``tensor``'s memory in C order (a copy only if not contiguous/CPU).

    The common case (a contiguous CPU tensor without grad, numpy-compatible dtype) takes one
    try: this runs once per tensor per message, and its fixed cost, not the byte copy (which
    msgspec does), decides the codec's speed for small trajectories (see bench/codec.py).
    """
    try:
        # numpy() raises for grad/GPU/bfloat16/conj tensors; cast() for non-contiguous or empty ones
        return memoryview(tensor.numpy()).cast("B")
    except (TypeError, RuntimeError, ValueError):
        return _raw_bytes_general(tensor)


def _raw_bytes_general(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16: same bytes as int16
        flat = flat.view(torch.int16)
    return memoryview(flat.numpy()).cast("B")


def decode_tensor(wire: WireTensor) -> torch.Tensor:
    """The tensor described by ``wire``, sharing its buffer. Raises ``TensorDecodeError``."""
    return as_tensor(decode_array(wire))


def encode_tensor_dict(tensors: dict[str, torch.Tensor]) -> dict[str, WireTensor]:
    return {key: encode_tensor(value) for key, value in tensors.items()}


def decode_tensor_dict(wire: dict[str, WireTensor]) -> dict[str, torch.Tensor]:
    return {key: as_tensor(decode_array(value)) for key, value in wire.items()}


def unpack_tensor_dict(packed: PackedTensors) -> dict[str, torch.Tensor]:
    """The tensors of ``packed``, in order, as views of its buffer. Raises ``TensorDecodeError``."""
    return {key: as_tensor(array) for key, array in unpack_arrays(packed).items()}


def group_tensors(group: EmittedGroup) -> dict[str, torch.Tensor]:
    """An emitted group's tensors (:func:`rollstream.wire.codec.group_arrays` as torch tensors):
    views of the message buffer, read-only. Raises ``WireDecodeError`` when they are
    inconsistent (``decode_group`` has already checked that for decoded groups)."""
    return {key: as_tensor(array) for key, array in group_arrays(group).items()}


def allocate_packed(specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """Writable, uninitialised tensors ``{key: dtype[shape]}``, in ``specs`` order, that are views
    of one buffer in the packed layout: fill them, and ``pack_tensor_dict`` does not copy.

    ``TypeError`` for a dtype the wire does not carry, ``ValueError`` for a repeated key.
    """
    return tensor_arena(allocate_arrays([(key, _wire_name(key, dtype), shape) for key, dtype, shape in specs]))


def tensor_arena(arena: ArrayArena) -> dict[str, torch.Tensor]:
    """The tensors of ``arena``: views of its one buffer (one torch storage), which
    ``pack_tensor_dict`` packs without a copy while they are unchanged. The arena's arrays
    must still be the ones it handed out (``ArrayArena.unchanged``)."""
    layout = arena.layout
    storage = torch.from_numpy(arena.buffer).untyped_storage()
    tensors = {
        # set_ on the one shared storage: one op, half the cost of from_numpy per tensor
        key: torch.empty(0, dtype=DTYPES[name]).set_(storage, offset // ITEMSIZES[name], shape)
        for key, name, shape, offset in zip(layout.keys, layout.names, layout.shapes, layout.offsets)
    }
    if tensors:
        first = next(iter(tensors.values()))
        setattr(first, _ARENA_ATTRIBUTE, _ArenaRecord.of(tensors, arena.packed))
    return tensors


_ARENA_ATTRIBUTE = "_rollstream_packed_arena"


@dataclass(frozen=True)
class _ArenaRecord:
    """What ``allocate_packed`` handed out, kept on its first tensor so that packing the same
    tensors again is a lookup: their ids and shapes, and the ready ``PackedTensors``. It holds
    no reference to the tensors (no reference cycle keeps an arena alive)."""

    ids: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    packed: PackedTensors

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], packed: PackedTensors) -> _ArenaRecord:
        return cls(tuple(map(id, tensors.values())), tuple(t.shape for t in tensors.values()), packed)

    def describes(self, tensors: dict[str, torch.Tensor]) -> bool:
        """True when ``tensors`` are the handed-out tensors, same keys, order and shapes (an
        in-place ``resize_`` changes the shape and falls back to the general path)."""
        return (
            len(tensors) == len(self.ids)
            and all(id(t) == i and t.shape == s for t, i, s in zip(tensors.values(), self.ids, self.shapes))
            and list(tensors) == self.packed.keys
        )


def _pack_recorded(tensors: dict[str, torch.Tensor]) -> PackedTensors | None:
    """The ready description of an unchanged ``allocate_packed`` dict (2-3 µs); else None.
    Runs per emitted group, so it reads no tensor attribute but ids and shapes."""
    first = next(iter(tensors.values()), None)
    record = getattr(first, _ARENA_ATTRIBUTE, None)
    return record.packed if record is not None and record.describes(tensors) else None


def _check_tensors(tensors: dict[str, torch.Tensor]) -> None:
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"packed tensors must be tensors, {key!r} is {type(value).__name__}")


def pack_tensor_dict(tensors: dict[str, torch.Tensor]) -> PackedTensors:
    """``tensors`` as one wire buffer, in dict order.

    Zero copy for the unchanged tensors of an :func:`allocate_packed` dict (same tensors, keys,
    order and shapes); otherwise one copy of each tensor into a new buffer, which also handles
    non-contiguous, GPU, grad, negative-view, bfloat16, 0-dim and empty tensors.
    ``TypeError`` for a value that is not a tensor or a dtype the wire does not carry.
    """
    _check_tensors(tensors)
    packed = _pack_recorded(tensors)
    if packed is not None:
        return packed
    specs: list[ArraySpec] = [(key, _wire_name(key, value.dtype), value.shape) for key, value in tensors.items()]
    return pack_copy(specs, [raw_bytes(value) for value in tensors.values()])


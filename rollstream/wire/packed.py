"""Several tensors in ONE buffer on the wire, and the arena builders fill to make that free.

Why: msgspec writes each bin of a message separately and grows its output buffer as it goes,
so a message with one bin per tensor is copied several times; one bin is copied about once
(bench/codec.py). ``PackedTensors`` therefore carries a whole tensor dict in one ``data`` bin.

Layout (the contract between writers and readers): tensor ``i`` (``keys[i]``, ``dtypes[i]``,
``shapes[i]``, C order, little-endian) starts at the first offset at or after the end of
tensor ``i - 1`` that is a multiple of its item size (natural alignment, as in a C struct;
tensor 0 at offset 0), and ``data`` ends exactly where the last tensor ends. Offsets are
implied, never sent. The padding bytes (at most ``itemsize - 1`` before a tensor) carry no
meaning; the arena writes zeros. Alignment is relative to ``data``: it lets a writer view one
byte buffer as typed arrays, but a decoded ``data`` may start at any address (msgpack places
bins anywhere), which numpy and torch read fine.

This module is numpy only (bfloat16 as ``uint16`` words, :mod:`rollstream.wire.dtypes`).
Writers: :func:`allocate_arrays` hands out writable arrays that already lie in that layout
(an :class:`ArrayArena`), so after filling them :func:`pack_arrays` only describes them (zero
copy); any other dict is copied into a new arena first. Readers: :func:`unpack_arrays` returns
views of ``data`` (treat them as read-only), after :func:`check_packed`. The torch versions
(``allocate_packed``, ``pack_tensor_dict``, ``unpack_tensor_dict``) are in
:mod:`rollstream.wire.torch_tensors`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy

from rollstream.wire.dtypes import ITEMSIZES, NUMPY_DTYPES, wire_name
from rollstream.wire.tensor_codec import Shape, TensorDecodeError, array_bytes, check_shape

ArraySpec = tuple[str, str, Sequence[int]]  # key, wire dtype name, shape


class PackedTensors(msgspec.Struct, array_like=True, frozen=True):
    """A tensor dict in one buffer: per tensor its key, dtype name and shape, in order; the
    bytes of all of them in ``data`` (layout in the module docstring)."""

    keys: list[str]
    dtypes: list[str]
    shapes: list[Shape]
    data: memoryview


def _aligned(offset: int, itemsize: int) -> int:
    return -(-offset // itemsize) * itemsize


def check_packed(packed: PackedTensors) -> tuple[list[int], list[int]]:
    """Validate ``packed``; the byte offset and element count of each tensor.

    Raises ``TensorDecodeError`` when the three lists differ in length, a key repeats, a dtype
    is unknown, a shape is invalid, or the tensors do not fill ``data`` exactly.
    """
    keys, dtypes, shapes = packed.keys, packed.dtypes, packed.shapes
    if not len(keys) == len(dtypes) == len(shapes):
        raise TensorDecodeError(
            f"packed tensors have {len(keys)} keys, {len(dtypes)} dtypes and {len(shapes)} shapes"
        )
    if len(set(keys)) != len(keys):
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        raise TensorDecodeError(f"packed tensors repeat keys {repeated}")
    offsets, counts, end = [], [], 0
    for key, name, shape in zip(keys, dtypes, shapes):
        itemsize = ITEMSIZES.get(name)
        if itemsize is None:
            raise TensorDecodeError(f"packed tensor {key!r} has unknown dtype {name!r}")
        count = check_shape(shape, key)
        offset = -(-end // itemsize) * itemsize  # _aligned, inlined: this runs per decoded batch
        offsets.append(offset)
        counts.append(count)
        end = offset + count * itemsize
    if end != packed.data.nbytes:
        raise TensorDecodeError(
            f"packed tensors {keys} with shapes {shapes} need {end} bytes, got {packed.data.nbytes}"
        )
    return offsets, counts


def unpack_arrays(packed: PackedTensors) -> dict[str, numpy.ndarray]:
    """The arrays of ``packed``, in order, as views of its buffer. Raises ``TensorDecodeError``."""
    offsets, counts = check_packed(packed)
    data = packed.data
    return {
        # one positional numpy call builds the shaped view: faster than frombuffer + reshape
        key: numpy.ndarray(shape, NUMPY_DTYPES[name], data, offset) if count else numpy.empty(shape, NUMPY_DTYPES[name])
        for key, name, shape, offset, count in zip(packed.keys, packed.dtypes, packed.shapes, offsets, counts)
    }


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a packed buffer goes (writer side; readers use ``check_packed``)."""

    keys: list[str]
    names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    sizes: list[int]  # bytes
    end: int

    @classmethod
    def of(cls, specs: Sequence[ArraySpec]) -> Layout:
        """``ValueError`` for a repeated key, ``TypeError`` for a dtype the wire does not carry."""
        keys = [key for key, _, _ in specs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"packed keys repeat: {sorted({k for k in keys if keys.count(k) > 1})}")
        names, shapes, offsets, sizes, end = [], [], [], [], 0
        for key, name, shape in specs:
            itemsize = ITEMSIZES.get(name)
            if itemsize is None:
                raise TypeError(f"unsupported tensor dtype on the wire: {key!r} is {name}")
            shape = [int(n) for n in shape]
            offset = _aligned(end, itemsize)
            size = math.prod(shape) * itemsize
            names.append(name)
            shapes.append(shape)
            offsets.append(offset)
            sizes.append(size)
            end = offset + size
        return cls(keys, names, shapes, offsets, sizes, end)

    def buffer(self) -> numpy.ndarray:
        """An uninitialised byte buffer of this layout, its padding bytes zeroed."""
        base = numpy.empty(self.end, dtype=numpy.uint8)
        previous_end = 0
        for offset, size in zip(self.offsets, self.sizes):
            if offset > previous_end:
                base[previous_end:offset] = 0
            previous_end = offset + size
        return base

    def packed(self, base: numpy.ndarray) -> PackedTensors:
        return PackedTensors(self.keys, self.names, self.shapes, memoryview(base))

    def views(self, base: numpy.ndarray) -> list[numpy.ndarray]:
        """Each tensor's writable array in ``base``, in order."""
        return [
            numpy.ndarray(shape, NUMPY_DTYPES[name], base, offset)
            for name, shape, offset in zip(self.names, self.shapes, self.offsets)
        ]


class ArrayArena(dict[str, numpy.ndarray]):
    """Arrays that are views of one buffer in the packed layout (:func:`allocate_arrays`), and
    that buffer's ready description: packing them again is a lookup while the dict still holds
    the arrays it was given (same keys, order, objects and shapes)."""

    __slots__ = ("layout", "buffer", "packed", "_ids", "_shapes")

    def __init__(self, layout: Layout, base: numpy.ndarray) -> None:
        arrays = layout.views(base)
        super().__init__(zip(layout.keys, arrays))
        self.layout = layout
        self.buffer = base  # the bytes, padding included
        self.packed = layout.packed(base)
        self._ids = tuple(map(id, arrays))
        self._shapes = tuple(a.shape for a in arrays)

    def unchanged(self) -> bool:
        """True while the dict holds the handed-out arrays, with their keys, order and shapes."""
        values = self.values()
        return (
            len(values) == len(self._ids)
            and all(id(a) == i and a.shape == s for a, i, s in zip(values, self._ids, self._shapes))
            and list(self) == self.packed.keys
        )


def allocate_arrays(specs: Sequence[ArraySpec]) -> ArrayArena:
    """Writable, uninitialised arrays ``{key: dtype[shape]}`` (wire dtype names), in ``specs``
    order, that are views of one buffer in the packed layout: fill them, and ``pack_arrays``
    does not copy. ``TypeError`` for a dtype the wire does not carry, ``ValueError`` for a
    repeated key."""
    layout = Layout.of(specs)
    return ArrayArena(layout, layout.buffer())


def _check_arrays(arrays: dict[str, Any]) -> None:
    for key, value in arrays.items():
        if not isinstance(value, numpy.ndarray):
            raise TypeError(f"packed tensors must be arrays, {key!r} is {type(value).__name__}")


def _array_specs(arrays: dict[str, numpy.ndarray]) -> list[ArraySpec]:
    specs: list[ArraySpec] = []
    for key, value in arrays.items():
        name = wire_name(value.dtype)
        if name is None:
            raise TypeError(f"unsupported tensor dtype on the wire: {key!r} is {value.dtype}")
        specs.append((key, name, value.shape))
    return specs


def pack_copy(specs: Sequence[ArraySpec], raw: list[memoryview]) -> PackedTensors:
    """A new packed buffer for ``specs`` holding each tensor's raw little-endian bytes ``raw``."""
    layout = Layout.of(specs)
    base = layout.buffer()
    for data, offset, size in zip(raw, layout.offsets, layout.sizes):
        if size:
            base[offset : offset + size] = data
    return layout.packed(base)


def pack_arrays(arrays: dict[str, numpy.ndarray]) -> PackedTensors:
    """``arrays`` as one wire buffer, in dict order.

    Zero copy for an unchanged :class:`ArrayArena`; otherwise one copy of each array into a
    new buffer (any strides, byte order, 0-dim and empty arrays). ``TypeError`` for a value
    that is not an array or a dtype the wire does not carry (``uint16`` is bfloat16 words).
    """
    if isinstance(arrays, ArrayArena) and arrays.unchanged():
        return arrays.packed
    _check_arrays(arrays)
    return pack_copy(_array_specs(arrays), [array_bytes(value) for value in arrays.values()])


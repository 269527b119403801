"""Tensors on the wire: (dtype, shape, raw little-endian bytes), decoded without copying.

This module is numpy only: the tiers that run no model (producer, grouping, dump) never
import torch. Encoding hands msgspec a view of the array's memory, so the only copy is into
the message buffer. Decoding returns arrays that share the message's buffer: treat them as
read-only (copy before writing in place). bfloat16 arrays are ``uint16`` words
(:mod:`rollstream.wire.dtypes`). The torch versions of these functions are in
:mod:`rollstream.wire.torch_tensors`.
"""

from __future__ import annotations

import math
import sys
from typing import Annotated

import msgspec
import numpy

from rollstream.wire.dtypes import ITEMSIZES, NUMPY_DTYPES, wire_name

if sys.byteorder != "little":  # pragma: no cover - the wire format is little-endian
    raise ImportError("rollstream's tensor wire format needs a little-endian host")

MAX_TENSOR_DIMS = 8
MAX_TENSOR_DIM = 2**31 - 1  # no real tensor has a larger dimension, empty or not
MAX_TENSOR_ELEMENTS = 64 * 1024 * 1024  # = the largest message (codec.MAX_MESSAGE_BYTES) in bools

# A shape as the wire allows it: at most MAX_TENSOR_DIMS dimensions in 0..MAX_TENSOR_DIM
# (msgspec refuses anything else at decode, naming the field); check_shape adds the count.
Shape = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TENSOR_DIM)]], msgspec.Meta(max_length=MAX_TENSOR_DIMS)]


class TensorDecodeError(ValueError):
    """A wire tensor whose dtype, shape or byte count is not consistent."""


class WireTensor(msgspec.Struct, array_like=True, frozen=True):
    """One tensor: dtype name, shape, and its bytes in C order, little-endian."""

    dtype: str
    shape: Shape
    data: memoryview


def check_shape(shape: list[int], key: str | None = None) -> int:
    """The element count of ``shape``; ``TensorDecodeError`` unless every dimension is in
    0..MAX_TENSOR_DIM, there are at most MAX_TENSOR_DIMS of them, and the product of the
    non-zero ones is at most MAX_TENSOR_ELEMENTS (so an empty tensor cannot declare a shape
    like ``[0, 2**63]`` that breaks whatever computes with it later). ``key`` names the
    tensor of a packed dict in the error."""
    count = math.prod(shape)
    # the common case in one test (this runs per tensor of every decoded message): dimensions
    # all >= 1 whose product is in range are each in range too
    if 0 < count <= MAX_TENSOR_ELEMENTS and len(shape) <= MAX_TENSOR_DIMS and (not shape or min(shape) > 0):
        return count
    what = "tensor" if key is None else f"packed tensor {key!r}"
    if len(shape) > MAX_TENSOR_DIMS or any(not 0 <= d <= MAX_TENSOR_DIM for d in shape):
        raise TensorDecodeError(f"{what} has invalid shape {shape}")
    if math.prod(d for d in shape if d) > MAX_TENSOR_ELEMENTS:
        raise TensorDecodeError(f"{what} shape {shape} declares more than {MAX_TENSOR_ELEMENTS} elements")
    return count


def check_tensor(wire: WireTensor) -> numpy.dtype:
    """Validate ``wire`` (dtype, shape, byte count) without building an array; its numpy
    dtype (bfloat16: ``uint16`` words). Raises ``TensorDecodeError``; ``decode_array`` runs
    the same checks."""
    dtype = NUMPY_DTYPES.get(wire.dtype)
    if dtype is None:
        raise TensorDecodeError(f"unknown tensor dtype {wire.dtype!r}")
    shape = wire.shape
    expected = check_shape(shape) * ITEMSIZES[wire.dtype]
    if wire.data.nbytes != expected:
        raise TensorDecodeError(
            f"tensor of shape {shape} and dtype {wire.dtype} needs {expected} bytes, "
            f"got {wire.data.nbytes}"
        )
    return dtype


def decode_array(wire: WireTensor) -> numpy.ndarray:
    """The array described by ``wire``, sharing its buffer (read-only when the buffer is).
    Raises ``TensorDecodeError``."""
    dtype = check_tensor(wire)
    if wire.data.nbytes == 0:
        return numpy.empty(wire.shape, dtype)
    # one positional call builds the shaped view: faster than frombuffer + reshape
    return numpy.ndarray(wire.shape, dtype, wire.data)


def encode_array(array: numpy.ndarray) -> WireTensor:
    """Describe ``array`` for the wire; no copy when it is C-contiguous and little-endian.
    ``TypeError`` for a dtype the wire does not carry (``uint16`` is bfloat16 words)."""
    name = wire_name(array.dtype)
    if name is None:
        raise TypeError(f"unsupported tensor dtype on the wire: {array.dtype}")
    return WireTensor(name, list(array.shape), array_bytes(array))


def array_bytes(array: numpy.ndarray) -> memoryview:
    """A flat little-endian byte view of ``array`` in C order (one copy only if it is not
    C-contiguous or not little-endian)."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if array.size == 0:
        return memoryview(b"")
    return memoryview(numpy.ascontiguousarray(array)).cast("B")


def encode_arrays(arrays: dict[str, numpy.ndarray]) -> dict[str, WireTensor]:
    return {key: encode_array(value) for key, value in arrays.items()}


def decode_arrays(wire: dict[str, WireTensor]) -> dict[str, numpy.ndarray]:
    return {key: decode_array(value) for key, value in wire.items()}


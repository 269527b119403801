"""Tensors on the wire: (dtype, shape, raw little-endian bytes), decoded without copying.

Encoding hands msgspec a view of the tensor's memory, so the only copy is into the
message buffer. Decoding returns tensors that share the message's buffer: treat them as
read-only (clone before writing in place).
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Annotated

import msgspec
import numpy
import torch

if sys.byteorder != "little":  # pragma: no cover - the wire format is little-endian
    raise ImportError("rollstream's tensor wire format needs a little-endian host")

# torch warns when wrapping an immutable buffer; sharing the message buffer is the point.
warnings.filterwarnings("ignore", message="The given buffer is not writable")
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZES: dict[str, int] = {k: torch.empty(0, dtype=v).element_size() for k, v in DTYPES.items()}
NUMPY_DTYPES: dict[str, numpy.dtype] = {k: numpy.dtype(k) for k in DTYPES if k != "bfloat16"}
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


def check_shape(shape: list[int], what: str = "tensor") -> int:
    """The element count of ``shape``; ``TensorDecodeError`` unless every dimension is in
    0..MAX_TENSOR_DIM, there are at most MAX_TENSOR_DIMS of them, and the product of the
    non-zero ones is at most MAX_TENSOR_ELEMENTS (so an empty tensor cannot declare a shape
    like ``[0, 2**63]`` that breaks whatever computes with it later)."""
    if len(shape) > MAX_TENSOR_DIMS or any(not 0 <= d <= MAX_TENSOR_DIM for d in shape):
        raise TensorDecodeError(f"{what} has invalid shape {shape}")
    if math.prod(d for d in shape if d) > MAX_TENSOR_ELEMENTS:
        raise TensorDecodeError(f"{what} shape {shape} declares more than {MAX_TENSOR_ELEMENTS} elements")
    return math.prod(shape)


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


def check_tensor(wire: WireTensor) -> torch.dtype:
    """Validate ``wire`` (dtype, shape, byte count) without building a tensor; its dtype.

    Raises ``TensorDecodeError``. ``decode_tensor`` runs the same checks.
    """
    dtype = DTYPES.get(wire.dtype)
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


def decode_tensor(wire: WireTensor) -> torch.Tensor:
    """The tensor described by ``wire``, sharing its buffer. Raises ``TensorDecodeError``."""
    dtype = check_tensor(wire)
    shape = wire.shape
    if wire.data.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    np_dtype = NUMPY_DTYPES.get(wire.dtype)
    if np_dtype is None:  # bfloat16: numpy cannot describe it
        return torch.frombuffer(wire.data, dtype=dtype).view(tuple(shape))
    # numpy builds the shaped view faster than torch.frombuffer(...).view(...); one tensor results
    return torch.from_numpy(numpy.frombuffer(wire.data, dtype=np_dtype).reshape(shape))


def encode_tensor_dict(tensors: dict[str, torch.Tensor]) -> dict[str, WireTensor]:
    return {key: encode_tensor(value) for key, value in tensors.items()}


def decode_tensor_dict(wire: dict[str, WireTensor]) -> dict[str, torch.Tensor]:
    return {key: decode_tensor(value) for key, value in wire.items()}

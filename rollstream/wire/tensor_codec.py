"""Tensors on the wire: (dtype, shape, raw little-endian bytes), decoded without copying.

Encoding hands msgspec a view of the tensor's memory, so the only copy is into the
message buffer. Decoding returns tensors that share the message's buffer: treat them as
read-only (clone before writing in place).
"""

from __future__ import annotations

import math
import sys
import warnings

import msgspec
import torch

if sys.byteorder != "little":  # pragma: no cover - the wire format is little-endian
    raise ImportError("rollstream's tensor wire format needs a little-endian host")

# torch warns when wrapping an immutable buffer; sharing the message buffer is the point.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

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
MAX_TENSOR_DIMS = 8


class TensorDecodeError(ValueError):
    """A wire tensor whose dtype, shape or byte count is not consistent."""


class WireTensor(msgspec.Struct, array_like=True, frozen=True):
    """One tensor: dtype name, shape, and its bytes in C order, little-endian."""

    dtype: str
    shape: list[int]
    data: memoryview


def encode_tensor(tensor: torch.Tensor) -> WireTensor:
    """Describe ``tensor`` for the wire without copying its memory (CPU tensors)."""
    name = DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise TypeError(f"unsupported tensor dtype on the wire: {tensor.dtype}")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return WireTensor(name, list(tensor.shape), memoryview(raw.numpy()))


def decode_tensor(wire: WireTensor) -> torch.Tensor:
    """The tensor described by ``wire``, sharing its buffer. Raises ``TensorDecodeError``."""
    dtype = DTYPES.get(wire.dtype)
    if dtype is None:
        raise TensorDecodeError(f"unknown tensor dtype {wire.dtype!r}")
    shape = wire.shape
    if len(shape) > MAX_TENSOR_DIMS or any(d < 0 for d in shape):
        raise TensorDecodeError(f"invalid tensor shape {shape}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(wire.data) != expected:
        raise TensorDecodeError(
            f"tensor of shape {shape} and dtype {wire.dtype} needs {expected} bytes, "
            f"got {len(wire.data)}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(wire.data, dtype=dtype).reshape(shape)


def encode_tensor_dict(tensors: dict[str, torch.Tensor]) -> dict[str, WireTensor]:
    return {key: encode_tensor(value) for key, value in tensors.items()}


def decode_tensor_dict(wire: dict[str, WireTensor]) -> dict[str, torch.Tensor]:
    return {key: decode_tensor(value) for key, value in wire.items()}

"""The dtypes the wire carries, as numpy sees them: names, item sizes, promotion, bfloat16 words.

The wire names ten dtypes (:data:`WIRE_DTYPES`). Nine are numpy dtypes. ``bfloat16`` is not:
numpy-side code (the producer, grouping and dump tiers, which never import torch) carries it
as its raw 2-byte words in a ``uint16`` array. The wire has no ``uint16``, so a ``uint16``
array always means bfloat16 words, and :func:`wire_name` maps it back. Only arithmetic needs
the values (:func:`to_float32`, :func:`bfloat16_words`); copies, slices and padding with a
converted fill value work on the words as they are. Torch users get real ``torch.bfloat16``
tensors (``rollstream.wire.torch_tensors``).
"""

from __future__ import annotations

import functools

import numpy

WIRE_DTYPES: tuple[str, ...] = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
)
BFLOAT16_WORDS = numpy.dtype("<u2")  # how numpy-side code holds a bfloat16 tensor
NUMPY_DTYPES: dict[str, numpy.dtype] = {
    name: BFLOAT16_WORDS if name == "bfloat16" else numpy.dtype(name).newbyteorder("<") for name in WIRE_DTYPES
}
ITEMSIZES: dict[str, int] = {name: dtype.itemsize for name, dtype in NUMPY_DTYPES.items()}
_NAMES: dict[numpy.dtype, str] = {dtype: name for name, dtype in NUMPY_DTYPES.items()}
_INTEGER_LIMITS = {name: numpy.iinfo(d) for name, d in NUMPY_DTYPES.items() if d.kind in "iu" and name != "bfloat16"}
_CATEGORY = {"bool": 0, "uint8": 1, "int8": 1, "int16": 1, "int32": 1, "int64": 1,
             "float16": 2, "bfloat16": 2, "float32": 2, "float64": 2}


def wire_name(dtype: numpy.dtype) -> str | None:
    """The wire name of a numpy dtype (``uint16`` is ``bfloat16``); None when the wire does
    not carry it. Big-endian dtypes name their little-endian twin (encoders swap the bytes)."""
    found = _NAMES.get(dtype)
    return found if found is not None else _NAMES.get(dtype.newbyteorder("<"))


def promote(first: str, second: str) -> str:
    """The dtype two wire dtypes concatenate to, by torch's rules (``torch.promote_types``),
    so numpy-side padding gives what torch's gives: a higher category (bool < integer <
    floating) wins as it is (``int64`` with ``float16`` is ``float16``, where numpy would say
    ``float64``); integers promote as numpy does; ``float16`` with ``bfloat16`` is ``float32``;
    other floats, the larger one."""
    if first == second:
        return first
    categories = _CATEGORY[first], _CATEGORY[second]
    if categories[0] != categories[1]:
        return first if categories[0] > categories[1] else second
    if categories[0] == 1:
        return numpy.result_type(first, second).name
    if {first, second} == {"float16", "bfloat16"}:
        return "float32"
    return first if ITEMSIZES[first] > ITEMSIZES[second] else second


def promote_all(names: set[str]) -> str:
    return functools.reduce(promote, sorted(names))


def to_float32(array: numpy.ndarray) -> numpy.ndarray:
    """``array`` as float32 values; bfloat16 words (``uint16``) are widened exactly. No copy
    when it already is float32."""
    if array.dtype == BFLOAT16_WORDS:
        return (array.astype(numpy.uint32) << 16).view(numpy.float32)
    return array.astype(numpy.float32, copy=False)


def bfloat16_words(values: numpy.ndarray | float) -> numpy.ndarray:
    """``values`` rounded to bfloat16 as torch rounds (to nearest, ties to even; NaN stays a
    quiet NaN), as ``uint16`` words."""
    floats = numpy.asarray(values, dtype=numpy.float32)
    bits = floats.view(numpy.uint32).astype(numpy.uint64)  # 64 bits: the rounding bias cannot wrap
    words = ((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16).astype(numpy.uint16)
    return numpy.where(numpy.isnan(floats), numpy.uint16(0x7FC0), words)


def cast(array: numpy.ndarray, source: str, target: str) -> numpy.ndarray:
    """``array`` (wire dtype ``source``) with the values of wire dtype ``target``, as torch's
    ``Tensor.to`` converts them (truncating floats to integers; bfloat16 through float32)."""
    if source == target:
        return array
    if source == "bfloat16":
        array = to_float32(array)
    if target == "bfloat16":
        return bfloat16_words(array.astype(numpy.float32))
    return array.astype(NUMPY_DTYPES[target])


def fill_value(value: float, name: str) -> float | numpy.generic:
    """What to assign to an array of wire dtype ``name`` to pad it with ``value``: bfloat16's
    word for it, else ``value`` itself (numpy converts it on assignment as torch's padding does).
    A value an integer dtype cannot hold is refused, as torch refuses it (numpy would wrap it:
    -1 into uint8 is 255)."""
    if name == "bfloat16":
        return bfloat16_words(value)[()]
    limits = _INTEGER_LIMITS.get(name)
    if limits is not None:
        if not limits.min <= value <= limits.max:
            raise ValueError(f"pad value {value} cannot be converted to {name} without overflow")
    return value

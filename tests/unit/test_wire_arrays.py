"""The wire's numpy face, which the producer, grouping and dump tiers use without torch: dtype
promotion and bfloat16 words as torch has them, array round trips, and packing arenas without
a copy (the padding into an arena: tests/unit/test_trajectory_padding.py)."""

from __future__ import annotations

import itertools

import numpy
import pytest
import torch

from rollstream.wire import (
    EmittedGroup,
    WireTensor,
    allocate_arrays,
    decode_array,
    decode_group,
    encode,
    encode_array,
    group_arrays,
    pack_arrays,
)
from rollstream.wire.dtypes import WIRE_DTYPES, bfloat16_words, cast, promote, to_float32, wire_name
from rollstream.wire.torch_tensors import DTYPES, as_array, as_tensor, group_tensors

FLOATS = torch.tensor([0.0, -0.0, 1.0, -2.5, 7.0, 1 / 3, 2 / 3, 1.00390625, 1.01171875, 1.0078125 + 2**-9,
                       3.3895314e38, 3.3961776e38, 1e-40, -1e-45, 65504.0, float("inf"), float("-inf")])


def test_promotion_is_torch_promotion_for_every_pair() -> None:
    for first, second in itertools.product(WIRE_DTYPES, repeat=2):
        assert DTYPES[promote(first, second)] == torch.promote_types(DTYPES[first], DTYPES[second]), (first, second)


def test_bfloat16_words_round_like_torch_and_widen_exactly() -> None:
    values = torch.cat([FLOATS, torch.randn(10_000) * 1e3])
    words = bfloat16_words(values.numpy())
    want = values.to(torch.bfloat16)
    assert numpy.array_equal(words, want.view(torch.int16).numpy().view(numpy.uint16))
    assert numpy.array_equal(to_float32(words), want.float().numpy())
    assert numpy.isnan(to_float32(bfloat16_words(float("nan"))))


@pytest.mark.parametrize(("source", "target"), list(itertools.product(WIRE_DTYPES, repeat=2)))
def test_cast_converts_like_torch(source: str, target: str) -> None:
    values = torch.tensor([0, 1, 2, 3, 100, -7, 127]) if source != "bool" else torch.tensor([0, 1, 1, 0])
    tensor = values.to(DTYPES[source])
    got = cast(as_array(tensor), source, target)
    want = tensor.to(DTYPES[target])
    assert wire_name(got.dtype) == target
    assert torch.equal(as_tensor(numpy.ascontiguousarray(got)), want)


@pytest.mark.parametrize("array", [
    numpy.arange(12, dtype=numpy.int64).reshape(3, 4).T,  # not contiguous
    numpy.arange(6, dtype=">i4").reshape(2, 3),  # big-endian: sent little-endian
    numpy.array(True),  # 0-dim
    numpy.zeros((2, 0, 3), dtype=numpy.float16),  # empty
    bfloat16_words(numpy.array([[1.5, -2.0]], dtype=numpy.float32)),  # bfloat16 words
], ids=["transposed", "big-endian", "0-dim", "empty", "bfloat16"])
def test_arrays_round_trip_and_reach_torch_with_their_values(array: numpy.ndarray) -> None:
    wire = encode_array(array)
    decoded = decode_array(WireTensor(wire.dtype, wire.shape, memoryview(bytes(wire.data))))
    assert decoded.shape == array.shape and numpy.array_equal(decoded, array)
    assert not decoded.flags.writeable or decoded.size == 0  # a view of the (read-only) message
    tensor = as_tensor(decoded)
    if array.dtype == numpy.uint16:
        assert tensor.dtype == torch.bfloat16 and tensor.tolist() == [[1.5, -2.0]]
    else:
        assert numpy.array_equal(tensor.numpy(), array)


def test_the_wire_refuses_what_it_does_not_carry() -> None:
    with pytest.raises(TypeError, match="unsupported tensor dtype on the wire: complex64"):
        encode_array(numpy.zeros(2, dtype=numpy.complex64))
    with pytest.raises(TypeError, match="'u' is uint32"):
        pack_arrays({"u": numpy.zeros(2, dtype=numpy.uint32)})
    with pytest.raises(TypeError, match="must be arrays, 'ids' is list"):
        pack_arrays({"ids": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="'z' is float8"):
        allocate_arrays([("z", "float8", (2,))])


def batch_of(arrays: dict[str, numpy.ndarray]) -> EmittedGroup:
    return EmittedGroup(task_id="a", group_size=1, sample_idx=[0],
                 packed=pack_arrays(arrays))


def test_an_unchanged_arena_packs_without_a_copy_and_a_changed_one_is_copied() -> None:
    arena = allocate_arrays([("ids", "int32", (2, 3)), ("mask", "bool", (2, 3)), ("logp", "float32", (2, 3))])
    arena["ids"][...] = 7
    arena["mask"][...] = True
    arena["logp"][...] = -1.5
    packed = pack_arrays(arena)
    assert packed is arena.packed and numpy.shares_memory(numpy.asarray(packed.data), arena["logp"])
    read = group_arrays(decode_group(encode(batch_of(arena))))
    assert read["ids"].tolist() == [[7] * 3] * 2 and read["logp"].tolist() == [[-1.5] * 3] * 2
    arena["logp"] = numpy.zeros((2, 3), dtype=numpy.float32)  # replaced: packing copies the new values
    repacked = pack_arrays(arena)
    assert repacked is not arena.packed
    assert group_arrays(decode_group(encode(batch_of(arena))))["logp"].tolist() == [[0.0] * 3] * 2
    plain = pack_arrays(dict(arena))  # a plain dict of the same arrays: one copy, same bytes
    assert bytes(plain.data) == bytes(repacked.data)


def test_batch_arrays_and_batch_tensors_read_the_same_values() -> None:
    arrays = {"ids": numpy.arange(6, dtype=numpy.int32).reshape(2, 3),
              "h": bfloat16_words(numpy.array([0.5, -3.0], dtype=numpy.float32))}
    batch = decode_group(encode(batch_of(arrays)))
    as_numpy, as_torch = group_arrays(batch), group_tensors(batch)
    assert numpy.array_equal(as_numpy["ids"], as_torch["ids"].numpy())
    assert as_torch["h"].dtype == torch.bfloat16 and as_torch["h"].tolist() == [0.5, -3.0]
    assert numpy.array_equal(as_numpy["h"], as_torch["h"].view(torch.int16).numpy().view(numpy.uint16))

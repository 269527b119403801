"""Packed tensors (one buffer per batch): layout, round trips, zero copy, malformed input."""

from __future__ import annotations

import re

import msgspec
import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.wire import EmittedGroup, PackedTensors, WireDecodeError, check_packed, decode_group, encode
from rollstream.wire.messages import SCHEMA_VERSION
from rollstream.wire.tensor_codec import TensorDecodeError
from rollstream.wire.torch_tensors import (
    DTYPES,
    allocate_packed,
    encode_tensor_dict,
    group_tensors,
    pack_tensor_dict,
    unpack_tensor_dict,
)


def batch_of(packed: PackedTensors, **kw) -> EmittedGroup:
    return EmittedGroup(task_id="a", group_size=1, sample_idx=[0],
                 packed=packed, **kw)


def round_trip(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Through the wire as a grouping tier writes a batch and a trainer reads it."""
    return group_tensors(decode_group(encode(batch_of(pack_tensor_dict(tensors)))))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key], value), key


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=gen).to(dtype)


def test_every_dtype_and_odd_shapes_round_trip() -> None:
    tensors = {f"{name}-{i}": sample(dtype, shape, i)
               for name, dtype in DTYPES.items()
               for i, shape in enumerate([(), (0,), (3,), (2, 0, 4), (3, 5), (1, 1, 1, 7)])}
    assert_same(round_trip(tensors), tensors)


def test_non_contiguous_grad_and_negative_views_are_copied_right() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    complex_ = torch.tensor([1 + 2j], dtype=torch.complex64)
    tensors = {
        "transposed": base.t(),
        "strided": base[:, ::2],
        "grad": torch.ones(3, requires_grad=True) * 2,
        "negative": complex_.conj().imag,  # a float tensor whose negation is lazy (neg bit)
        "bf16_strided": base.to(torch.bfloat16)[::2],
    }
    assert tensors["negative"].is_neg()
    got = round_trip(tensors)
    assert_same(got, {k: v.detach().resolve_neg().contiguous() for k, v in tensors.items()})


def test_empty_dict_round_trips() -> None:
    packed = pack_tensor_dict({})
    assert packed.keys == [] and packed.data.nbytes == 0
    assert round_trip({}) == {}


def test_layout_aligns_each_tensor_to_its_item_size_and_zeroes_padding() -> None:
    arena = allocate_packed([("flags", torch.bool, (3,)), ("x", torch.float64, (1,)), ("h", torch.int16, (1,))])
    arena["flags"].fill_(True)
    arena["x"].fill_(1.5)
    arena["h"].fill_(7)
    data = bytes(pack_tensor_dict(arena).data)
    assert len(data) == 3 + 5 + 8 + 2  # bool at 0, 5 padding bytes, float64 at 8, int16 at 16
    assert data[:8] == b"\x01\x01\x01\x00\x00\x00\x00\x00"
    assert data[8:16] == numpy.float64(1.5).tobytes() and data[16:] == numpy.int16(7).tobytes()


def test_arena_dict_packs_without_a_copy() -> None:
    arena = allocate_packed([("ids", torch.int32, (4, 9)), ("mask", torch.bool, (4, 9)),
                             ("empty", torch.float32, (0, 9)), ("logp", torch.float32, (4, 9)),
                             ("scalar", torch.bfloat16, ())])
    for tensor in arena.values():
        tensor.fill_(1)
    packed = pack_tensor_dict(arena)
    data = numpy.asarray(packed.data)
    assert data.ctypes.data == arena["ids"].data_ptr()
    for key in ("ids", "mask", "logp"):
        assert numpy.shares_memory(data, arena[key].numpy()), key
    arena["logp"][2, 3] = -4.0  # the packed bytes ARE the arena
    assert unpack_tensor_dict(packed)["logp"][2, 3] == -4.0


def test_an_unchanged_arena_packs_by_lookup_and_a_changed_one_is_checked_again() -> None:
    arena = allocate_packed([("ids", torch.int32, (2, 3)), ("logp", torch.float32, (2, 3))])
    arena["ids"].fill_(7)
    arena["logp"].fill_(-1.5)
    first = pack_tensor_dict(arena)
    assert pack_tensor_dict(dict(arena)) is first  # the same tensors in a new dict: the ready description
    shrunk = dict(arena)
    shrunk["ids"] = arena["ids"][:1]  # another tensor: described from scratch
    assert_same(round_trip(shrunk), {"ids": torch.full((1, 3), 7, dtype=torch.int32), "logp": arena["logp"]})
    arena["logp"].resize_(6)  # a member reshaped in place: not the recorded layout any more
    repacked = pack_tensor_dict(arena)
    assert repacked is not first and repacked.shapes == [[2, 3], [6]]
    assert_same(round_trip(arena), {"ids": torch.full((2, 3), 7, dtype=torch.int32),
                                    "logp": torch.full((6,), -1.5)})


def test_dicts_not_in_an_arena_layout_are_copied() -> None:
    arena = allocate_packed([("a", torch.int32, (2, 3)), ("b", torch.float32, (2, 3))])
    for tensor in arena.values():
        tensor.fill_(2)
    cases = {
        "separate tensors": {"a": torch.ones(2, 3, dtype=torch.int32), "b": torch.ones(2, 3)},
        "arena reordered": {"b": arena["b"], "a": arena["a"]},
        "arena with a gap": {"a": arena["a"][:1], "b": arena["b"]},
        "arena and a clone": {"a": arena["a"], "b": arena["b"].clone()},
    }
    for name, tensors in cases.items():
        packed = pack_tensor_dict(tensors)
        data = numpy.asarray(packed.data)
        assert not any(numpy.shares_memory(data, t.numpy()) for t in tensors.values()), name
        assert_same(unpack_tensor_dict(packed), {k: v.contiguous() for k, v in tensors.items()})


def test_unpacked_tensors_view_the_message_buffer() -> None:
    message = encode(batch_of(pack_tensor_dict({"x": torch.arange(10, dtype=torch.int64)})))
    tensors = group_tensors(decode_group(message))
    buffer = numpy.frombuffer(message, dtype=numpy.uint8)
    assert numpy.shares_memory(buffer, tensors["x"].numpy())


@settings(max_examples=60, derandomize=True, database=None, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 4), max_size=3)),
                      max_size=6),
       in_arena=st.booleans())
def test_any_dict_round_trips(specs: list[tuple[str, list[int]]], in_arena: bool) -> None:
    tensors = {f"k{i}": sample(DTYPES[name], tuple(shape), i) for i, (name, shape) in enumerate(specs)}
    if in_arena:
        arena = allocate_packed([(k, v.dtype, v.shape) for k, v in tensors.items()])
        for key, value in tensors.items():
            arena[key].copy_(value)
        tensors = arena
    assert_same(round_trip(tensors), tensors)


def test_pack_refuses_what_the_wire_cannot_carry() -> None:
    with pytest.raises(TypeError, match="'ids' is list"):
        pack_tensor_dict({"ids": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="complex64"):
        pack_tensor_dict({"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="complex64"):
        allocate_packed([("z", torch.complex64, (2,))])
    with pytest.raises(ValueError, match="repeat"):
        allocate_packed([("a", torch.int32, (2,)), ("a", torch.int32, (2,))])


def good_packed() -> PackedTensors:
    return pack_tensor_dict({"ids": torch.arange(6, dtype=torch.int32).reshape(2, 3), "r": torch.ones(2)})


def malformed() -> dict[str, tuple[PackedTensors, str, str]]:
    """name -> (packed, check_packed's reason, the decoder's reason)."""
    good = good_packed()
    data = bytes(good.data)

    def with_(**fields) -> PackedTensors:
        return msgspec.structs.replace(good, **fields)
    cases = {
        "too few bytes": (with_(data=memoryview(data[:-1])), "need 32 bytes, got 31"),
        "too many bytes": (with_(data=memoryview(data + b"\x00" * 4)), "need 32 bytes, got 36"),
        "unknown dtype": (with_(dtypes=["int32", "complex64"]), "'r' has unknown dtype 'complex64'"),
        "duplicate keys": (with_(keys=["ids", "ids"]), "repeat keys ['ids']"),
        "huge empty": (with_(shapes=[[0, 2**31 - 1], [2]]), "declares more than 67108864 elements"),
        "lengths differ": (with_(dtypes=["int32"]), "2 keys, 1 dtypes and 2 shapes"),
    }
    # the shape's own rules are in the wire types: the decoder names the field
    typed = {
        "negative dim": (with_(shapes=[[-2, -3], [2]]), "'ids' has invalid shape [-2, -3]",
                         "Expected `int` >= 0 - at `$.packed[2][0][0]`"),
        "too many dims": (with_(shapes=[[1] * 9 + [6], [2]]), "invalid shape", "length <= 8 - at `$.packed[2][0]`"),
    }
    return {name: (packed, reason, reason) for name, (packed, reason) in cases.items()} | typed


@pytest.mark.parametrize("name", sorted(malformed()))
def test_malformed_packed_tensors_are_decode_errors(name: str) -> None:
    packed, reason, decoder_reason = malformed()[name]
    with pytest.raises(TensorDecodeError, match=re.escape(reason)):
        check_packed(packed)
    with pytest.raises(WireDecodeError, match=re.escape(decoder_reason)):
        decode_group(encode(batch_of(packed)))
    with pytest.raises(WireDecodeError):
        group_tensors(batch_of(packed))  # a batch built here, never decoded: the same check


def test_batches_before_packing_are_refused() -> None:
    """What a schema-1 writer sent: tensors as one WireTensor each, no packed field at all."""
    tensors = {"input_ids": torch.arange(6, dtype=torch.int32).reshape(2, 3)}
    old = msgspec.msgpack.decode(encode(batch_of(good_packed()))) | {"schema_version": 1}
    del old["packed"]
    old["tensors"] = msgspec.to_builtins(encode_tensor_dict(tensors))
    with pytest.raises(WireDecodeError, match="packed"):
        decode_group(msgspec.msgpack.encode(old))


def test_batches_write_schema_version_3_and_other_kinds_1() -> None:
    assert SCHEMA_VERSION == 3
    assert msgspec.msgpack.decode(encode(batch_of(good_packed())))["schema_version"] == 3
    newer = msgspec.msgpack.decode(encode(batch_of(good_packed()))) | {"schema_version": 4}
    with pytest.raises(WireDecodeError, match="unsupported schema_version 4"):
        decode_group(msgspec.msgpack.encode(newer))

"""The one padding (``rollstream.trajectory.padding``): the rules WORKFLOWS.md promises, checked
against expectations written here by hand (nested Python lists, no padding code of ours), for
numpy arrays and for the torch tensors that view them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rollstream.trajectory.padding import concat_padded_arrays, concat_padded_tensors
from rollstream.trajectory.rows import trajectory_dtypes, trajectory_row, validate_trajectory
from rollstream.wire import ArrayArena, WireTensor, decode_array, encode_array, pack_arrays
from rollstream.wire.torch_tensors import DTYPES, as_array, as_tensor, pack_tensor_dict


def row(prompt: int, out: int, version: int = 3, reward: float = 1.0) -> dict[str, torch.Tensor]:
    return trajectory_row(
        list(range(1, prompt + 1)), [50] * out, [-0.5] * out, [version] * out, reward=reward, is_truncated=False
    )


def test_empty_gives_empty_dict() -> None:
    assert concat_padded_tensors([]) == {} and concat_padded_arrays([]) == {}


def test_one_dict_is_copied_as_it_is() -> None:
    d = {**row(2, 2), "s": torch.tensor(4), "l": [1, 2]}
    out = concat_padded_tensors([d])
    assert list(out) == list(d) and out["s"].shape == ()  # a 0-dim value stays 0-dim
    for key, value in d.items():
        if isinstance(value, list):
            assert out[key] == value and out[key] is not value
        else:
            assert torch.equal(out[key], value) and not numpy.shares_memory(out[key].numpy(), value.numpy()), key


def test_right_pads_to_longest_with_key_specific_values() -> None:
    short, long = row(2, 1), row(3, 4)
    out = concat_padded_tensors([short, long], pad_value=7.0)
    assert out["input_ids"].shape == (2, 7)
    # attention_mask pads with False, versions with -1, everything else with pad_value
    assert out["attention_mask"][0].tolist() == [True] * 3 + [False] * 4
    assert out["versions"][0].tolist() == [-1, -1, 3] + [-1] * 4
    assert out["input_ids"][0].tolist() == [1, 2, 50] + [7] * 4
    assert out["loss_mask"][0].tolist() == [0, 0, 1] + [7] * 4
    assert out["logprobs"][0, 3:].tolist() == [7.0] * 4
    assert out["input_ids"][1].tolist() == [1, 2, 3, 50, 50, 50, 50]
    assert out["rewards"].shape == (2,) and out["is_truncated"].shape == (2,)


def test_dtypes_are_kept() -> None:
    out = concat_padded_tensors([row(1, 1), row(2, 2)])
    for key, dtype in trajectory_dtypes.items():
        assert out[key].dtype == dtype, key
    validate_trajectory(out)


def test_pads_every_non_batch_dim() -> None:
    a = {"x": torch.ones(1, 2, 3)}
    b = {"x": torch.ones(2, 4, 1)}
    out = concat_padded_tensors([a, b], pad_value=-9.0)
    assert out["x"].shape == (3, 4, 3)
    assert out["x"][0, 2:, :].eq(-9.0).all() and out["x"][0, :2, :].eq(1.0).all()
    assert out["x"][1, :, 1:].eq(-9.0).all()


def test_zero_dim_tensors_are_stacked_and_lists_joined() -> None:
    out = concat_padded_tensors([{"s": torch.tensor(1.0), "l": [1]}, {"s": torch.tensor(2.0), "l": [2, 3]}])
    assert out["s"].tolist() == [1.0, 2.0]
    assert out["l"] == [1, 2, 3]


@pytest.mark.parametrize("pad", [concat_padded_tensors, concat_padded_arrays], ids=["tensors", "arrays"])
def test_what_cannot_be_padded_raises_naming_it(pad: Callable[..., Any]) -> None:
    def as_input(d: dict[str, Any]) -> dict[str, Any]:
        return d if pad is concat_padded_tensors else {k: v.numpy() if isinstance(v, torch.Tensor) else v
                                                       for k, v in d.items()}

    a, b = row(1, 1), row(1, 1)
    del b["rewards"]
    b["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"lacks \['rewards'\].*extra \['extra'\]"):
        pad([as_input(a), as_input(b)])
    with pytest.raises(ValueError, match="different ranks"):
        pad([as_input({"x": torch.zeros(1)}), as_input({"x": torch.zeros(1, 2)})])
    with pytest.raises(TypeError, match="all be tensors or all be lists"):
        pad([as_input({"x": torch.zeros(1)}), {"x": [1]}])
    with pytest.raises(ValueError, match="without overflow"):  # torch refuses it too; numpy would wrap
        pad([as_input({"versions": torch.zeros(1, 1, dtype=torch.uint8)}),
             as_input({"versions": torch.zeros(1, 2, dtype=torch.uint8)})])


def test_a_dtype_the_wire_does_not_carry_is_refused() -> None:
    with pytest.raises(TypeError, match="'x' is complex64"):
        concat_padded_tensors([{"x": torch.zeros(1, 2, dtype=torch.complex64)}, {"x": torch.zeros(1, 1)}])
    with pytest.raises(TypeError, match="'x' is torch.uint16"):  # numpy would read it as bfloat16 words
        concat_padded_tensors([{"x": torch.zeros(1, 2, dtype=torch.uint16)}])


def test_tensors_are_views_of_one_buffer_in_key_order_and_pack_without_a_copy() -> None:
    out = concat_padded_tensors([row(2, 1), row(3, 4)])
    tensors = list(out.values())
    for before, after in zip(tensors, tensors[1:]):
        assert before.untyped_storage().data_ptr() == after.untyped_storage().data_ptr()
        assert before.data_ptr() + before.nbytes <= after.data_ptr()  # in order, no overlap
    data = numpy.asarray(pack_tensor_dict(out).data)
    assert all(numpy.shares_memory(data, tensor.numpy()) for tensor in out.values())


def test_grad_bfloat16_and_strided_inputs_come_back_detached_on_the_cpu() -> None:
    weights = torch.ones(1, 2, requires_grad=True)
    out = concat_padded_tensors([
        {"w": weights * 2, "h": torch.ones(1, 2, dtype=torch.bfloat16), "t": torch.arange(12).reshape(3, 4).t()[:1]},
        {"w": torch.ones(1, 3), "h": torch.ones(1, 4, dtype=torch.bfloat16), "t": torch.arange(6).reshape(2, 3)},
    ], pad_value=-1.0)
    assert not out["w"].requires_grad and out["w"].device.type == "cpu"
    assert out["w"].tolist() == [[2.0, 2.0, -1.0], [1.0, 1.0, 1.0]]
    assert out["h"].dtype == torch.bfloat16 and out["h"].tolist() == [[1.0, 1.0, -1.0, -1.0], [1.0] * 4]
    assert out["t"].tolist() == [[0, 4, 8], [0, 1, 2], [3, 4, 5]]
    out["w"][0, 0] = 5.0  # fresh, writable memory
    assert weights.tolist() == [[1.0, 1.0]]


# -- the rules against expectations written by hand --

def expected(dicts: list[dict[str, torch.Tensor]], pad_value: float) -> dict[str, torch.Tensor]:
    """What the rules say, computed on nested Python lists: each row right-padded with its key's
    value (attention_mask 0, versions -1, else pad_value), converted to the dtype torch
    promotes the parts to."""
    out = {}
    for key in dicts[0]:
        parts = [d[key] for d in dicts]
        dtype = functools.reduce(torch.promote_types, [p.dtype for p in parts])
        fill = {"attention_mask": 0, "versions": -1}.get(key, pad_value)
        if parts[0].dim() == 0:
            values: list[Any] = [p.item() for p in parts]
            shape: tuple[int, ...] = (len(values),)
        elif parts[0].dim() == 1:
            values = [x for p in parts for x in p.tolist()]
            shape = (len(values),)
        else:
            width = max(p.shape[1] for p in parts)
            values = [r + [fill] * (width - len(r)) for p in parts for r in p.tolist()]
            shape = (len(values), width)
        out[key] = torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype)
    return out


DTYPE_MIXES = [("int32", "int32"), ("int32", "int64"), ("int32", "float32"), ("bfloat16", "bfloat16"),
               ("bfloat16", "float32"), ("float16", "bfloat16"), ("int64", "bfloat16"), ("bool", "int8"),
               ("uint8", "int8"), ("int64", "float16"), ("bool", "bool")]


@settings(max_examples=80, deadline=None)
@example(mix=("bool", "bool"), lengths=[(1, 2), (2, 0)], pad_value=7.0, key="x")
@example(mix=("int32", "float32"), lengths=[(1, 1), (1, 3)], pad_value=-2.5, key="x")
@given(
    mix=st.sampled_from(DTYPE_MIXES),
    lengths=st.lists(st.tuples(st.integers(1, 3), st.integers(0, 6)), min_size=2, max_size=4),
    pad_value=st.sampled_from([0.0, 7.0, -2.5, 1 / 3]),
    key=st.sampled_from(["x", "versions", "attention_mask"]),
)
def test_padding_gives_what_the_rules_say(mix: tuple[str, str], lengths: list[tuple[int, int]],
                                          pad_value: float, key: str) -> None:
    dicts = []
    for i, (rows, length) in enumerate(lengths):
        dtype = DTYPES[mix[i % 2]]
        values = (torch.arange(rows * length).reshape(rows, length) % 5 - 1).to(dtype)
        dicts.append({key: values, "r": torch.full((rows,), i, dtype=dtype), "s": torch.tensor(i, dtype=dtype)})
    want = expected(dicts, pad_value)
    got_arrays = concat_padded_arrays([read_only_arrays(d) for d in dicts], pad_value)
    got_tensors = concat_padded_tensors(dicts, pad_value)
    assert isinstance(got_arrays, ArrayArena) and pack_arrays(got_arrays) is got_arrays.packed
    for got in ({k: as_tensor(v) for k, v in got_arrays.items()}, got_tensors):
        assert list(got) == list(want)
        for name, value in want.items():
            assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
            assert torch.equal(got[name], value), (name, got[name], value)


def read_only_arrays(tensors: dict[str, torch.Tensor]) -> dict[str, numpy.ndarray]:
    """``tensors`` as the grouping tier has them: decoded from a record (read-only views)."""
    out = {}
    for key, tensor in tensors.items():
        wire = encode_array(as_array(tensor))
        out[key] = decode_array(WireTensor(wire.dtype, wire.shape, memoryview(bytes(wire.data))))
    return out

"""concat_padded_tensors (and its arena variant), validate_trajectory and row building."""

from __future__ import annotations

from collections.abc import Callable

import numpy
import pytest
import torch

from rollstream.tensors import (
    TrajectoryBuilder,
    concat_padded_arena,
    concat_padded_tensors,
    trajectory_dtypes,
    trajectory_row,
    validate_trajectory,
)
from rollstream.wire.torch_tensors import pack_tensor_dict


def row(prompt: int, out: int, version: int = 3, reward: float = 1.0) -> dict[str, torch.Tensor]:
    return trajectory_row(
        list(range(1, prompt + 1)), [50] * out, [-0.5] * out, [version] * out, reward=reward, is_truncated=False
    )


def test_empty_gives_empty_dict() -> None:
    assert concat_padded_tensors([]) == {}


def test_single_dict_is_shallow_copy() -> None:
    d = row(2, 2)
    out = concat_padded_tensors([d])
    assert out == d and out is not d
    assert all(out[k] is d[k] for k in d)


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


def test_mismatched_keys_raise_naming_them() -> None:
    a, b = row(1, 1), row(1, 1)
    del b["rewards"]
    b["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"lacks \['rewards'\].*extra \['extra'\]"):
        concat_padded_tensors([a, b])


def test_mismatched_ranks_raise() -> None:
    with pytest.raises(ValueError, match="different ranks"):
        concat_padded_tensors([{"x": torch.zeros(1)}, {"x": torch.zeros(1, 2)}])


ARENA_CASES: dict[str, Callable[[], list[dict]]] = {
    "mixed lengths": lambda: [row(2, 1), row(3, 4, version=5), row(1, 6, reward=0.0)],
    "several rows per dict": lambda: [concat_padded_tensors([row(2, 1), row(2, 3)]), row(4, 4)],
    "every non-batch dim": lambda: [{"x": torch.ones(1, 2, 3)}, {"x": torch.ones(2, 4, 1)}],
    "0-dim stacked, lists joined": lambda: [{"s": torch.tensor(1.0), "l": [1]}, {"s": torch.tensor(2.0), "l": [2, 3]}],
    "dtypes promoted": lambda: [{"x": torch.ones(1, 2, dtype=torch.int32), "r": torch.ones(1, dtype=torch.int32)},
                                {"x": torch.ones(1, 3, dtype=torch.int64), "r": torch.ones(1, dtype=torch.float32)}],
    "bfloat16 (no numpy)": lambda: [{"x": torch.ones(1, 2, dtype=torch.bfloat16)}, {"x": torch.ones(1, 4, dtype=torch.bfloat16)}],
    "parts that require grad": lambda: [{"x": torch.ones(1, 2, requires_grad=True)}, {"x": torch.ones(1, 3)}],
    "non-contiguous parts": lambda: [{"x": torch.arange(12).reshape(3, 4).t()[:1]}, {"x": torch.arange(6).reshape(2, 3)}],
    "one dict, as it is": lambda: [{"s": torch.tensor(3), "l": [1], "x": torch.ones(2, 3)}],
    "no dicts": lambda: [],
}


@pytest.mark.parametrize("name", sorted(ARENA_CASES))
@pytest.mark.parametrize("pad_value", [0.0, 7.0, -2.5])
def test_arena_variant_gives_the_same_tensors(name: str, pad_value: float) -> None:
    dicts = ARENA_CASES[name]()
    want = concat_padded_tensors(dicts, pad_value)
    got = concat_padded_arena(dicts, pad_value)
    assert list(got) == list(want)
    for key, value in want.items():
        if isinstance(value, list):
            assert got[key] == value, key
            continue
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key], value.detach()), key
        assert not got[key].requires_grad


def test_arena_variant_writes_every_tensor_into_one_buffer_in_key_order() -> None:
    out = concat_padded_arena([row(2, 1), row(3, 4)])
    tensors = list(out.values())
    for before, after in zip(tensors, tensors[1:]):
        assert before.untyped_storage().data_ptr() == after.untyped_storage().data_ptr()
        assert before.data_ptr() + before.nbytes <= after.data_ptr()  # in order, no overlap


def test_arena_variant_packs_without_a_copy() -> None:
    out = concat_padded_arena([row(2, 1), row(3, 4)])
    data = numpy.asarray(pack_tensor_dict(out).data)
    assert all(numpy.shares_memory(data, tensor.numpy()) for tensor in out.values())


def test_arena_variant_raises_like_concat_padded_tensors() -> None:
    a, b = row(1, 1), row(1, 1)
    del b["rewards"]
    with pytest.raises(ValueError, match=r"lacks \['rewards'\]"):
        concat_padded_arena([a, b])
    with pytest.raises(ValueError, match="different ranks"):
        concat_padded_arena([{"x": torch.zeros(1)}, {"x": torch.zeros(1, 2)}])
    with pytest.raises(TypeError, match="all be tensors or all be lists"):
        concat_padded_arena([{"x": torch.zeros(1)}, {"x": [1]}])


def test_builder_interleaves_prompt_and_output_segments() -> None:
    b = TrajectoryBuilder()
    b.add_prompt([1, 2])
    b.add_output([3], [-0.25], [4])
    b.add_prompt([5])
    b.add_output([6, 7], [-1.0, -2.0], [5, 6])
    td = b.to_tensors(reward=0.5)
    assert td["input_ids"].tolist() == [[1, 2, 3, 5, 6, 7]]
    assert td["loss_mask"].tolist() == [[0, 0, 1, 0, 1, 1]]
    assert td["versions"].tolist() == [[-1, -1, 4, -1, 5, 6]]
    assert td["logprobs"].tolist() == [[0.0, 0.0, -0.25, 0.0, -1.0, -2.0]]
    assert td["rewards"].tolist() == [0.5] and "is_truncated" not in td
    validate_trajectory(td)


def test_builder_refuses_missing_logprobs() -> None:
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        TrajectoryBuilder().add_output([1, 2], [0.0], [0, 0])


def test_builder_refuses_nested_segments_and_copies_its_inputs() -> None:
    with pytest.raises(ValueError, match="flat sequence"):
        TrajectoryBuilder().add_prompt([[1, 2]])
    ids = numpy.array([3, 4], dtype=numpy.int32)
    b = TrajectoryBuilder()
    b.add_output(ids, [-0.5, -0.5], [1, 1])
    td = b.to_tensors()
    ids[0] = 99  # the engine reuses its buffer: the row must not change
    assert td["input_ids"].tolist() == [[3, 4]] and td["attention_mask"].tolist() == [[True, True]]
    assert TrajectoryBuilder().to_tensors()["input_ids"].shape == (1, 0)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda td: td.pop("attention_mask"), r"lacks required keys \['attention_mask'\]"),
        (lambda td: td.update(input_ids=td["input_ids"].long()), "input_ids.*torch.int32.*torch.int64"),
        (lambda td: td.update(attention_mask=td["attention_mask"].int()), "attention_mask.*torch.bool"),
        (lambda td: td.update(loss_mask=td["loss_mask"].float()), "loss_mask.*torch.int32"),
        (lambda td: td.update(logprobs=td["logprobs"].double()), "logprobs.*torch.float32"),
        (lambda td: td.update(versions=td["versions"].long()), "versions.*torch.int32"),
        (lambda td: td.update(rewards=td["rewards"].double()), "rewards.*torch.float32"),
        (lambda td: td.update(loss_mask=td["loss_mask"][:, :-1]), r"loss_mask has shape \[2, 3\], expected \[2, 4\]"),
        (lambda td: td.update(rewards=torch.zeros(3)), r"rewards has shape \[3\], expected \[2\]"),
        (lambda td: td.update(input_ids=td["input_ids"][0]), r"input_ids must be \[B, L\]"),
        (lambda td: td["logprobs"].__setitem__((1, 2), float("nan")), r"NaN or inf at \[row, position\] \[\[1, 2\]\]"),
        (lambda td: td["logprobs"].__setitem__((0, 0), float("-inf")), "NaN or inf"),
    ],
)
def test_validate_trajectory_reports_the_problem(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    td = concat_padded_tensors([row(2, 2), row(1, 2)])
    validate_trajectory(td)
    mutate(td)
    with pytest.raises(ValueError, match=message):
        validate_trajectory(td)

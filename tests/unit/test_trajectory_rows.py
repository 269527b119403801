"""Trajectory rows: building a row from prompt and output segments, and validating a dict."""

from __future__ import annotations

import numpy
import pytest
import torch

from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.trajectory.rows import TrajectoryBuilder, trajectory_row, validate_trajectory


def row(prompt: int, out: int, version: int = 3, reward: float = 1.0) -> dict[str, torch.Tensor]:
    return trajectory_row(
        list(range(1, prompt + 1)), [50] * out, [-0.5] * out, [version] * out, reward=reward, is_truncated=False
    )


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

"""episode_tensors: what workflows return (the reference guide's forms included) becomes the
standard row, losslessly; what cannot is refused with one message naming the key."""

from __future__ import annotations

import pytest
import torch

from rollstream.api.io_struct import ModelResponse
from rollstream.trajectory.normalize import TrajectoryError, episode_tensors
from rollstream.trajectory.rows import trajectory_dtypes, trajectory_row

PROMPT, OUTPUT = [5, 6, 7], [8, 9]
RESPONSE = ModelResponse(input_tokens=PROMPT, output_tokens=OUTPUT, output_logprobs=[-0.25, -1.5],
                         output_versions=[3, 4], stop_reason="stop")
STANDARD = trajectory_row(PROMPT, OUTPUT, [-0.25, -1.5], [3, 4], reward=1.0)


def assert_standard(td: dict[str, torch.Tensor], expected: dict[str, torch.Tensor] = STANDARD) -> None:
    assert sorted(td) == sorted(expected)
    for key, value in expected.items():
        assert td[key].dtype == trajectory_dtypes[key], key
        assert torch.equal(td[key], value), key


def template_result(**overrides: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the reference guide's template returns (torch's default dtypes, no batch dim)."""
    return {"input_ids": torch.tensor(PROMPT), "output_ids": torch.tensor(OUTPUT), "reward": torch.tensor(1.0), **overrides}


def test_template_form_becomes_the_standard_row_with_engine_logprobs_and_versions() -> None:
    other = ModelResponse(input_tokens=[1], output_tokens=OUTPUT, output_logprobs=[0.0, 0.0], output_versions=[0, 0])
    assert_standard(episode_tensors(template_result(), [RESPONSE, other]))


def test_template_form_with_rewards_key_and_batch_dim() -> None:
    result = {"input_ids": torch.tensor([PROMPT]), "output_ids": torch.tensor([OUTPUT]), "rewards": torch.tensor([1])}
    assert_standard(episode_tensors(result, [RESPONSE]))


def test_template_form_without_engine_response_invents_no_logprobs_or_versions() -> None:
    td = episode_tensors(template_result(), [])
    assert sorted(td) == ["attention_mask", "input_ids", "loss_mask", "rewards"]
    assert td["input_ids"].tolist() == [PROMPT + OUTPUT] and td["loss_mask"].tolist() == [[0, 0, 0, 1, 1]]


def test_default_dtypes_without_batch_dim_or_attention_mask() -> None:
    result = {
        "input_ids": torch.tensor(PROMPT + OUTPUT),  # int64
        "loss_mask": torch.tensor([0, 0, 0, 1, 1]),  # int64
        "logprobs": torch.tensor([0.0, 0.0, 0.0, -0.25, -1.5], dtype=torch.float64),  # exact in float32
        "versions": torch.tensor([-1, -1, -1, 3, 4]),
        "rewards": torch.tensor(1, dtype=torch.int64),
    }
    assert_standard(episode_tensors(result))


def test_standard_row_passes_unchanged_and_unknown_keys_are_kept() -> None:
    result = {**STANDARD, "turn_ids": torch.zeros((1, 5), dtype=torch.int64)}
    td = episode_tensors(result)
    assert torch.equal(td["turn_ids"], result["turn_ids"]) and td["turn_ids"].dtype == torch.int64
    assert_standard({k: v for k, v in td.items() if k != "turn_ids"})


@pytest.mark.parametrize(
    ("result", "needle"),
    [
        (template_result(reward=torch.tensor(0.1, dtype=torch.float64)),
         "'rewards' has dtype torch.float64 and values that torch.float32 cannot hold exactly"),
        ({**STANDARD, "loss_mask": STANDARD["loss_mask"].long() + 2**31}, "'loss_mask' has dtype torch.int64 and values"),
        ({**STANDARD, "loss_mask": STANDARD["loss_mask"].double() * 0.5}, "'loss_mask' has dtype torch.float64"),
        ({**STANDARD, "attention_mask": torch.full((1, 5), 2)}, "'attention_mask' has dtype torch.int64"),
        (template_result(rewards=torch.tensor(1.0)), "both 'reward' and 'rewards'"),
        (template_result(loss_mask=torch.tensor([1, 1])), "'output_ids' and 'loss_mask'"),
        (template_result(output_ids=torch.tensor([OUTPUT, OUTPUT])), "'output_ids' has shape [2, 2]"),
        ({"output_ids": torch.tensor(OUTPUT)}, "lacks 'input_ids'"),
        ({k: v.repeat(2, 1) for k, v in STANDARD.items() if k not in ("attention_mask", "rewards")},
         "lacks 'attention_mask' and 'input_ids' has shape [2, 5]"),
        ({**STANDARD, "input_ids": torch.tensor(PROMPT + OUTPUT)}, "has shape [1, 5] while 'input_ids' has [5]"),
        ({**STANDARD, "versions": STANDARD["versions"].to(torch.complex64)}, "'versions' has dtype torch.complex64"),
    ],
)
def test_what_cannot_be_made_standard_is_refused_naming_the_key(result: dict, needle: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(TrajectoryError) as info:
        episode_tensors(result, [RESPONSE])
    assert needle in str(info.value), str(info.value)


def test_inconsistent_engine_response_is_refused() -> None:
    broken = ModelResponse(input_tokens=PROMPT, output_tokens=OUTPUT, output_logprobs=[-0.1], output_versions=[0, 0])
    with pytest.raises(TrajectoryError, match="inconsistent"):
        episode_tensors(template_result(), [broken])

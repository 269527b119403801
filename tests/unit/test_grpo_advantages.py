"""Group-normalised advantages and staleness stats of the example GRPO trainer (no broker)."""

from __future__ import annotations

import pytest
import torch

from rollstream.trainer.grpo import group_advantages, staleness_stats


def test_each_group_is_normalised_on_its_own() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 7.0])
    adv = group_advantages(rewards, [0, 0, 0, 0, 1, 1])
    first = torch.tensor([1.0, 0.0, 0.0, 0.0])
    expected_first = (first - first.mean()) / (first.std(unbiased=False) + 1e-6)
    assert torch.allclose(adv[:4], expected_first)
    assert torch.allclose(adv[4:], torch.tensor([-1.0, 1.0]), atol=1e-5)
    assert adv[:4].sum().abs() < 1e-5 and adv[4:].sum().abs() < 1e-5  # zero mean per group


def test_equal_rewards_and_single_rows_carry_no_signal() -> None:
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.3]), [0, 0, 0, 1])
    assert torch.equal(adv, torch.zeros(4))


def test_rows_of_a_group_need_not_be_adjacent() -> None:
    rewards = torch.tensor([1.0, 10.0, 0.0, 20.0])
    adv = group_advantages(rewards, torch.tensor([3, 7, 3, 7]))
    assert adv[0] > 0 > adv[2] and adv[3] > 0 > adv[1]
    assert torch.allclose(adv[[0, 2]], -adv[[2, 0]])


def test_advantage_is_scale_invariant_within_a_group() -> None:
    a = group_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0]), [0, 0, 0, 0])
    b = group_advantages(torch.tensor([0.0, 10.0, 10.0, 0.0]), [0, 0, 0, 0])
    assert torch.allclose(a, b, atol=1e-4)


def test_mismatched_group_labels_are_an_error() -> None:
    with pytest.raises(ValueError, match="row_group"):
        group_advantages(torch.tensor([1.0, 0.0]), [0])


def test_staleness_counts_only_generated_tokens() -> None:
    versions = torch.tensor([[-1, -1, 3, 4, -1], [-1, 2, 2, 2, 2]], dtype=torch.int32)
    loss_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]], dtype=torch.int32)
    stats = staleness_stats(versions, loss_mask, trainer_version=5)
    # generated tokens: 3, 4 (row 0) and 2, 2, 2 (row 1; the last 2 is outside the loss mask)
    assert stats.tokens == 5
    assert stats.max == 3 and stats.min == 1
    assert stats.mean == pytest.approx((2 + 1 + 3 + 3 + 3) / 5)


def test_staleness_without_generated_tokens_is_zero() -> None:
    stats = staleness_stats(torch.full((2, 3), -1), torch.zeros(2, 3), trainer_version=4)
    assert (stats.mean, stats.max, stats.min, stats.tokens) == (0.0, 0, 0, 0)

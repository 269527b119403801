"""The clipped policy-gradient loss, token logprobs and one policy update (no broker)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rollstream.trainer.grpo import clipped_policy_loss, policy_update, token_logprobs


def _inputs(new: list[float], old: list[float], mask: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.tensor([new]), torch.tensor([old]), torch.tensor([mask], dtype=torch.int32)


def test_on_policy_loss_is_minus_the_mean_advantage() -> None:
    lp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -0.7]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    loss, stats = clipped_policy_loss(lp, lp.clone(), torch.tensor([2.0, -1.0]), mask)
    assert loss.item() == pytest.approx(-(2 + 2 - 1 - 1) / 4)
    assert stats.clip_fraction == 0.0 and stats.ratio_mean == pytest.approx(1.0) and stats.tokens == 4


def test_gradient_raises_logprobs_of_positive_advantage_tokens() -> None:
    new = torch.tensor([[0.0, -1.0, -1.0]], requires_grad=True)
    loss, _ = clipped_policy_loss(new, new.detach().clone(), torch.tensor([1.5]), torch.tensor([[0, 1, 1]]))
    loss.backward()
    assert new.grad is not None
    assert (new.grad[0, 1:] < 0).all()  # descending the loss increases these logprobs
    assert new.grad[0, 0] == 0  # outside the mask: no gradient


def test_negative_advantage_pushes_logprobs_down() -> None:
    new = torch.tensor([[0.0, -1.0]], requires_grad=True)
    loss, _ = clipped_policy_loss(new, new.detach().clone(), torch.tensor([-1.0]), torch.tensor([[0, 1]]))
    loss.backward()
    assert new.grad[0, 1] > 0


def test_ratio_above_one_plus_clip_is_clipped_for_positive_advantage() -> None:
    old = [0.0, math.log(0.1)]
    new = [0.0, math.log(0.2)]  # ratio 2.0
    lp, old_t, mask = _inputs(new, old, [0, 1])
    lp.requires_grad_(True)
    loss, stats = clipped_policy_loss(lp, old_t, torch.tensor([1.0]), mask, clip=0.2)
    assert loss.item() == pytest.approx(-1.2, rel=1e-5)  # -A * (1 + clip)
    assert stats.clip_fraction == 1.0
    loss.backward()
    assert lp.grad is not None and lp.grad.abs().sum() == 0  # clipped: no push further


def test_ratio_below_one_minus_clip_is_clipped_for_negative_advantage() -> None:
    lp, old_t, mask = _inputs([0.0, math.log(0.05)], [0.0, math.log(0.1)], [0, 1])  # ratio 0.5
    loss, stats = clipped_policy_loss(lp, old_t, torch.tensor([-2.0]), mask, clip=0.2)
    assert loss.item() == pytest.approx(2.0 * 0.8, rel=1e-5)
    assert stats.clip_fraction == 1.0


def test_pessimistic_side_is_not_clipped() -> None:
    # ratio 2.0 with a negative advantage: the unclipped term is the larger loss and is kept
    lp, old_t, mask = _inputs([0.0, math.log(0.2)], [0.0, math.log(0.1)], [0, 1])
    loss, stats = clipped_policy_loss(lp, old_t, torch.tensor([-1.0]), mask, clip=0.2)
    assert loss.item() == pytest.approx(2.0, rel=1e-5)
    assert stats.clip_fraction == 0.0


def test_masked_tokens_do_not_count_even_with_extreme_ratios() -> None:
    lp, old_t, mask = _inputs([0.0, -1.0, 50.0], [-40.0, -1.0, -50.0], [0, 1, 0])
    loss, stats = clipped_policy_loss(lp, old_t, torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-1.0)
    assert math.isfinite(stats.approx_kl) and stats.tokens == 1


def test_no_loss_tokens_gives_a_zero_loss_with_a_graph() -> None:
    lp = torch.zeros(1, 3, requires_grad=True)
    loss, stats = clipped_policy_loss(lp, torch.zeros(1, 3), torch.tensor([1.0]), torch.zeros(1, 3))
    assert loss.item() == 0.0 and stats.tokens == 0
    loss.backward()


def test_clip_must_be_positive() -> None:
    with pytest.raises(ValueError, match="clip"):
        clipped_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), clip=0)


def test_token_logprobs_are_aligned_with_input_ids() -> None:
    logits = torch.randn(2, 4, 6)
    ids = torch.randint(0, 6, (2, 4))
    lp = token_logprobs(logits, ids, temperature=0.7)
    assert lp.shape == (2, 4) and (lp[:, 0] == 0).all()
    expected = torch.log_softmax(logits[1, 2] / 0.7, -1)[ids[1, 3]]
    assert lp[1, 3].item() == pytest.approx(expected.item(), rel=1e-5)


class _BigramLM(torch.nn.Module):
    """A model with the one attribute the update uses: ``forward(...).logits``."""

    def __init__(self, vocab: int = 5) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table(input_ids))


def test_policy_update_makes_rewarded_completions_more_likely() -> None:
    torch.manual_seed(0)
    model = _BigramLM()
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 4]])
    with torch.no_grad():
        old = token_logprobs(model(ids).logits, ids)
    tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
               "loss_mask": torch.tensor([[0, 1]] * 4, dtype=torch.int32), "logprobs": old}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    stats = policy_update(model, optimizer, tensors, torch.tensor([1.5, -0.5, -0.5, -0.5]), epochs=3)
    with torch.no_grad():
        new = token_logprobs(model(ids).logits, ids)
    assert new[0, 1] > old[0, 1] and (new[1:, 1] < old[1:, 1]).all()
    assert stats.loss.tokens == 4 and stats.grad_norm > 0
    assert not model.training

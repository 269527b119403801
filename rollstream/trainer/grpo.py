"""The GRPO math of the example trainer: pure functions over tensors, no broker, no I/O.

Conventions (those of the ``batches`` topic): tensors are ``[N, L]`` rows, right-padded;
``loss_mask`` is 1 on generated tokens; ``logprobs[:, t]`` is the behaviour policy's logprob of
``input_ids[:, t]`` (0.0 on the prompt); ``versions[:, t]`` is the weight version that generated
token ``t`` (-1 on prompt and padding); ``rewards`` is ``[N]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rollstream.trajectory.staleness import token_staleness
from rollstream.vision.forward import trajectory_logits
from rollstream.vision.inputs import VisionInputs

DEFAULT_CLIP = 0.2
DEFAULT_EPS = 1e-6


def group_advantages(rewards: Tensor, row_group: Sequence[int] | Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """``(r - mean_group) / (std_group + eps)`` per row, float32 ``[N]``.

    ``row_group[i]`` names the group of row ``i`` (any integer labels). The std is the
    population std (a group of one, or one whose rewards are all equal, gets advantage 0:
    it carries no signal about which sample was better).
    """
    rewards = rewards.detach().to(torch.float32).reshape(-1)
    groups = torch.as_tensor(row_group, dtype=torch.long).reshape(-1)
    if groups.shape != rewards.shape:
        raise ValueError(f"row_group has {groups.numel()} entries for {rewards.numel()} rewards")
    advantages = torch.zeros_like(rewards)
    for label in torch.unique(groups):
        rows = groups == label
        group = rewards[rows]
        advantages[rows] = (group - group.mean()) / (group.std(unbiased=False) + eps)
    return advantages


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """``out[:, t] = log_softmax(logits[:, t-1] / T)[input_ids[:, t]]``; ``out[:, 0] = 0``.

    ``logits`` are the model's ``[N, L, V]`` outputs for ``input_ids`` ``[N, L]``; the result is
    aligned with ``input_ids`` like the step's ``logprobs``. Divide by the sampling
    temperature so that the ratio against the behaviour logprobs compares like with like.
    """
    scaled = logits[:, :-1].float() / temperature
    picked = torch.log_softmax(scaled, dim=-1).gather(-1, input_ids[:, 1:].long().unsqueeze(-1)).squeeze(-1)
    return torch.cat([picked.new_zeros(picked.shape[0], 1), picked], dim=1)


@dataclass(frozen=True)
class LossStats:
    """Diagnostics of one loss evaluation (plain floats, for logs)."""

    loss: float
    clip_fraction: float  # share of loss tokens whose ratio was clipped
    ratio_mean: float
    approx_kl: float  # mean of (old - new) logprob over loss tokens
    tokens: int


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    clip: float = DEFAULT_CLIP,
) -> tuple[Tensor, LossStats]:
    """The PPO-clip surrogate, averaged over loss tokens: returns ``(loss, stats)``.

    Per token: ``ratio = exp(logprobs - old_logprobs)`` and
    ``max(-A * ratio, -A * clamp(ratio, 1 - clip, 1 + clip))`` with the row's advantage ``A``
    (``advantages`` is ``[N]``). Tokens with ``loss_mask == 0`` contribute nothing; rows
    without loss tokens give a zero loss that still has a graph. Minimising the loss raises
    the probability of tokens with positive advantage.
    """
    if clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    mask = loss_mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).reshape(-1, 1)
    log_ratio = (logprobs - old_logprobs.to(logprobs.dtype)) * mask  # 0 outside the mask: no inf
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    per_token = torch.maximum(unclipped, clipped)
    count = mask.sum()
    loss = (per_token * mask).sum() / count.clamp(min=1.0)
    with torch.no_grad():
        n = max(int(count.item()), 1)
        was_clipped = ((clipped > unclipped) & (mask > 0)).sum().item()
        stats = LossStats(
            loss=float(loss.item()),
            clip_fraction=was_clipped / n,
            ratio_mean=float((ratio * mask).sum().item() / n),
            approx_kl=float((-log_ratio * mask).sum().item() / n),
            tokens=int(count.item()),
        )
    return loss, stats


@dataclass(frozen=True)
class Staleness:
    """``trainer_version - token_version`` over generated tokens (all 0 when there are none)."""

    mean: float
    max: int
    min: int
    tokens: int


def staleness_stats(versions: Tensor, loss_mask: Tensor, trainer_version: int) -> Staleness:
    """How far behind the trainer the generated tokens of a step are (:func:`token_staleness`)."""
    lag = token_staleness(trainer_version, versions, loss_mask)
    if lag.size == 0:
        return Staleness(0.0, 0, 0, 0)
    return Staleness(float(lag.mean()), int(lag.max()), int(lag.min()), int(lag.size))


@dataclass(frozen=True)
class UpdateStats:
    """What :func:`policy_update` did: the last epoch's loss stats and its gradient norm."""

    loss: LossStats
    grad_norm: float


def policy_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, Tensor],
    advantages: Tensor,
    *,
    vision: VisionInputs | None = None,
    temperature: float = 1.0,
    clip: float = DEFAULT_CLIP,
    epochs: int = 1,
    max_grad_norm: float | None = 1.0,
) -> UpdateStats:
    """``epochs`` optimizer updates of :func:`clipped_policy_loss` on the rows of one step.

    ``tensors`` needs ``input_ids``, ``attention_mask``, ``loss_mask`` and ``logprobs`` (the
    behaviour policy's, which the ratio is taken against in every epoch). With ``vision``
    (``TrainingStep.vision``, a VLM's step) the forward pass shows each row its images
    (``rollstream.vision.forward.trajectory_logits``, the recipe the engine generated with). The
    model is left in eval mode.
    """
    if vision is not None:
        def new_logprobs() -> Tensor:
            return vision_token_logprobs(model, tensors, vision, temperature)
    else:
        device = next(model.parameters()).device
        input_ids = tensors["input_ids"].to(device=device, dtype=torch.long)
        attention = tensors["attention_mask"].to(device=device, dtype=torch.long)

        def new_logprobs() -> Tensor:
            return token_logprobs(model(input_ids=input_ids, attention_mask=attention).logits, input_ids, temperature)

    return ppo_epochs(model, optimizer, new_logprobs, tensors, advantages,
                      clip=clip, epochs=epochs, max_grad_norm=max_grad_norm)


def vision_token_logprobs(
    model: torch.nn.Module, tensors: dict[str, Tensor], vision: VisionInputs | None, temperature: float = 1.0,
) -> Tensor:
    """``[N, L]`` logprobs of the rows' tokens (aligned like the step's ``logprobs``) with their images."""
    logits = trajectory_logits(model, tensors, vision)
    return token_logprobs(logits, tensors["input_ids"].to(logits.device), temperature)


def ppo_epochs(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    new_logprobs: Callable[[], Tensor],
    tensors: dict[str, Tensor],
    advantages: Tensor,
    *,
    clip: float,
    epochs: int,
    max_grad_norm: float | None,
) -> UpdateStats:
    """``epochs`` optimizer updates of :func:`clipped_policy_loss`, ``new_logprobs()`` giving the
    ``[N, L]`` logprobs of the current weights each epoch (a text or a vision forward); the
    ratio is taken against ``tensors["logprobs"]`` over ``tensors["loss_mask"]``. The model is
    left in eval mode."""
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    device = next(model.parameters()).device
    loss_mask = tensors["loss_mask"].to(device)
    old = tensors["logprobs"].to(device=device, dtype=torch.float32)
    advantages = advantages.to(device)
    model.train()
    try:
        for _ in range(epochs):
            loss, stats = clipped_policy_loss(new_logprobs(), old, advantages, loss_mask, clip)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))
            optimizer.step()
    finally:
        model.eval()
    return UpdateStats(stats, float(norm))

"""Token sampling shared by the local engines, in SGLang's order.

Penalties (frequency penalty; stop tokens masked while fewer than ``min_new_tokens`` were
generated), then temperature, then top-k, then top-p on the renormalised top-k. The logprob
reported for a token is ``log_softmax(logits / T)`` after penalties and before filtering.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSpec:
    """Per-request sampling settings, resolved once at submission."""

    greedy: bool
    temperature: float  # 1.0 for greedy rows: the logprob temperature
    top_k: int  # <= 0 or >= vocab: off
    top_p: float
    min_new_tokens: int
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    frequency_penalty: float


def _apply_penalties(logits: torch.Tensor, specs: list[SamplingSpec], outs: list[list[int]]) -> None:
    """In place, as SGLang's penalizers: frequency penalty, stop tokens banned below min_new."""
    vocab = logits.shape[-1]
    for i, (spec, out) in enumerate(zip(specs, outs)):
        if spec.frequency_penalty and out:
            counts = torch.bincount(torch.tensor(out, device=logits.device), minlength=vocab)[:vocab]
            logits[i] -= spec.frequency_penalty * counts.to(logits.dtype)
        if len(out) < spec.min_new_tokens and spec.stop_ids:
            banned = [t for t in spec.stop_ids if 0 <= t < vocab]
            logits[i, banned] = float("-inf")


def _sample_filtered(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """Sample one token per row after top-k, then top-p on the renormalised top-k."""
    vocab = scaled.shape[-1]
    if not bool((top_k > 0).any() or (top_p < 1).any()):
        return torch.multinomial(torch.softmax(scaled, -1), 1, generator=gen).squeeze(1)
    sorted_logits, order = scaled.sort(-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k, vocab)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, -1)
    # Drop a token once the mass before it already reaches top_p; the top token always stays.
    drop = (probs.cumsum(-1) - probs) > top_p[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), -1)
    picked = torch.multinomial(probs, 1, generator=gen)
    return order.gather(-1, picked).squeeze(1)


def sample(
    logits: torch.Tensor, specs: list[SamplingSpec], outs: list[list[int]], gen: torch.Generator
) -> tuple[list[int], list[float]]:
    """Pick one token per row of float32 ``logits`` and return it with its logprob.

    The logprob is ``log_softmax(penalised_logits / T)`` at the token (T = 1 for greedy).
    """
    logits = logits.clone()
    _apply_penalties(logits, specs, outs)
    vocab = logits.shape[-1]
    temps = torch.tensor([s.temperature for s in specs], device=logits.device)
    scaled = logits / temps[:, None]
    tokens = logits.argmax(-1)
    sampled_rows = [i for i, s in enumerate(specs) if not s.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        top_k = torch.tensor([specs[i].top_k if 0 < specs[i].top_k < vocab else 0 for i in sampled_rows],
                             device=logits.device)
        top_p = torch.tensor([specs[i].top_p for i in sampled_rows], device=logits.device)
        tokens[rows] = _sample_filtered(scaled[rows], top_k, top_p, gen)
    logprobs = torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), logprobs.tolist()

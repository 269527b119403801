"""The demo's model: a tiny Qwen2 built offline, then taught the answer FORMAT, not the answers.

A randomly initialised model almost never writes "<digit><eos>", so reinforcement learning
would have no signal. :func:`warm_up` trains it for a few hundred supervised steps on sum
prompts followed by a RANDOM digit, mixed with operand-copy tasks (see
:func:`rollstream.demo.task.warmup_texts`): afterwards it answers with one digit and stops,
has features for the operands, and knows no sum; learning which digit is right is left to RL.
"""

from __future__ import annotations

import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.demo.task import tokenizer_corpus, warmup_texts
from rollstream.tiny.text_model import build_tiny_model

log = logging.getLogger(__name__)

WARMUP_BATCH = 32
WARMUP_LR = 3e-3


@dataclass(frozen=True)
class PreparedModel:
    path: Path
    warmup_loss: float  # mean token loss of the last warm-up batch (about ln(10)/3 when done)
    parameters: int


def _batch(tokenizer: Any, pairs: list[tuple[str, str]]) -> tuple[Any, Any, Any]:
    """``(input_ids, attention_mask, loss_mask)``: right-padded, loss on completion + eos."""
    import torch

    eos = tokenizer.eos_token_id
    encoded = [(tokenizer.encode(p), tokenizer.encode(c) + [eos]) for p, c in pairs]
    length = max(len(p) + len(c) for p, c in encoded)
    ids = torch.full((len(encoded), length), eos, dtype=torch.long)
    attention = torch.zeros((len(encoded), length), dtype=torch.long)
    loss_mask = torch.zeros((len(encoded), length))
    for row, (prompt, completion) in enumerate(encoded):
        end = len(prompt) + len(completion)
        ids[row, :end] = torch.tensor(prompt + completion)
        attention[row, :end] = 1
        loss_mask[row, len(prompt):end] = 1
    return ids, attention, loss_mask


def warm_up(model: Any, tokenizer: Any, pairs: list[tuple[str, str]], steps: int,
            batch_size: int = WARMUP_BATCH, lr: float = WARMUP_LR) -> float:
    """Supervised steps on ``pairs`` (cycled); returns the last batch's mean token loss."""
    import torch

    if steps <= 0 or not pairs:
        return float("nan")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        start = (step * batch_size) % len(pairs)
        chunk = (pairs + pairs)[start:start + batch_size]
        ids, attention, loss_mask = _batch(tokenizer, chunk)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = float(loss.item())
    model.eval()
    return loss_value


def prepare_model(out_dir: Path, *, warmup_steps: int, hidden_size: int = 64, num_layers: int = 2,
                  seed: int = 0) -> PreparedModel:
    """Build the tiny model and tokenizer, warm it up, and save it in ``out_dir`` (version 0)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_tiny_model(out_dir.parent / "base-model", tokenizer_corpus(),
                            vocab_size=300, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base)
        pairs = warmup_texts(warmup_steps * WARMUP_BATCH, seed=seed)
        random.Random(seed).shuffle(pairs)
        loss = warm_up(model, tokenizer, pairs, warmup_steps)
    return save_prepared(model, tokenizer, out_dir, loss, "model")


def save_prepared(model: Any, tokenizer: Any, out_dir: Path, loss: float, what: str) -> PreparedModel:
    """A warmed-up ``model`` and its ``tokenizer`` saved in ``out_dir`` (replacing what was there)."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    log.info("warmed-up %s (loss %.3f) saved in %s", what, loss, out_dir)
    return PreparedModel(out_dir, loss, sum(p.numel() for p in model.parameters()))

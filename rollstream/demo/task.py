"""The demo's task: one-digit sums, the prompts dataset, the warm-up texts and the reward.

Pure and light (no torch): the reward function runs in the reward worker's process pool.
Prompts look like ``"3+4="`` and the expected completion is ``"7"`` then eos.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SPECIAL_TEXTS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def problems(max_sum: int = 9, max_operand: int = 9) -> list[tuple[int, int]]:
    """Every ``(a, b)`` with ``0 <= a, b <= max_operand`` and ``a + b <= max_sum``."""
    return [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1) if a + b <= max_sum]


def prompt_text(a: int, b: int) -> str:
    # The answer follows the operands directly: a tiny model learns to look two tokens back
    # much sooner than across a longer template.
    return f"{a}+{b}="


def dataset_rows(count: int, seed: int = 0, max_operand: int = 9) -> list[dict[str, Any]]:
    """``count`` rows ``{"prompt", "answer"}`` (seeded) from :func:`problems`, balanced by answer.

    The answer is drawn uniformly first, then a problem with that answer: with every answer
    equally likely, always writing the most common answer cannot pay, so the reward rises
    only when the model reads the operands.
    """
    rng = random.Random(seed)
    by_answer: dict[int, list[tuple[int, int]]] = {}
    for a, b in problems(max_operand=max_operand):
        by_answer.setdefault(a + b, []).append((a, b))
    answers = sorted(by_answer)
    rows = []
    for _ in range(count):
        a, b = rng.choice(by_answer[rng.choice(answers)])
        rows.append({"prompt": prompt_text(a, b), "answer": str(a + b)})
    return rows


def write_dataset(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` as JSONL (one object per line); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def tokenizer_corpus() -> list[str]:
    """The text the demo's byte-level BPE tokenizer is trained on: every prompt and answer."""
    lines = [f"{prompt_text(a, b)}{d}" for a, b in problems() for d in range(10)]
    return lines + [f"{a}{op}{b}={a}" for a, b in problems() for op in "&|"]


def warmup_texts(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``(prompt, completion)`` pairs for the supervised warm-up; never a correct sum.

    Half are sum prompts with a RANDOM answer digit: the model learns the format (one digit,
    then stop) but not the sums. The other half are copy tasks with other operators
    (``"3&4="`` -> ``"3"``, ``"3|4="`` -> ``"4"``), so that the model learns to read the
    operands; without them the warm-up teaches it to ignore the question (any answer is as
    good as another), and reinforcement learning could only find the most frequent answer.
    """
    rng = random.Random(seed)
    pool = problems()
    pairs = []
    for _ in range(count):
        a, b = rng.choice(pool)
        kind = rng.random()
        if kind < 0.5:
            pairs.append((prompt_text(a, b), str(rng.randrange(10))))
        elif kind < 0.75:
            pairs.append((f"{a}&{b}=", str(a)))
        else:
            pairs.append((f"{a}|{b}=", str(b)))
    return pairs


def digit_answer_reward(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any
) -> float:
    """1.0 when the completion, without special tokens and surrounding spaces, IS the answer.

    Stricter than containing it, so that listing several digits does not pay.
    """
    answer = str(data.get("answer", "")).strip()
    for special in SPECIAL_TEXTS:
        completion = completion.replace(special, "")
    return 1.0 if answer and completion.strip() == answer else 0.0

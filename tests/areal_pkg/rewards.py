"""A reward function as AReaL's built-in workflows call it (module-level: it pickles into AReaL's
reward process pool)."""

from __future__ import annotations

import re
from typing import Any


def answer_reward(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    """1.0 when the completion contains ``data["answer"]`` as a whole number, else 0.0."""
    return 1.0 if str(data.get("answer")) in re.findall(r"\d+", completions) else 0.0


def half_reward(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    """0.5 for every completion: every group's rewards are equal."""
    return 0.5

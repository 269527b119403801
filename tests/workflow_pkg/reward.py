"""The reward function of the worked example (module-level and light, so it pickles into the
reward process pool and starts fast there)."""

from __future__ import annotations

import re
from typing import Any


def number_reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    """1.0 when the completion contains ``data["answer"]`` as a whole number, else 0.0."""
    return 1.0 if str(data.get("answer")) in re.findall(r"\d+", completion) else 0.0

"""Reward functions for the reward worker's subprocess tests.

Kept in their own light module (no torch, no transformers): the worker's process pool
imports this module in every pool process, and a heavy import there would dominate the test.
"""

from __future__ import annotations

import time
from typing import Any

from rollstream.rewards import exact_match_reward


def slow_exact_match(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    """exact_match_reward, slowed down so a worker can be killed in the middle of a stream."""
    time.sleep(0.1)
    return exact_match_reward(prompt, completion, prompt_ids, completion_ids, **data)

"""The chaos run's reward function: exact match, except that every sample of one prompt in
:data:`FAILING_SHARE` raises (chosen by a digest of the prompt text, so all samples of a group
fail together). Those groups end as counted ``all_failed`` drops, which return their staleness
slots: the drop path of the accounting runs all along, not only when a fault makes a group
stale. Module-level and light: the reward workers' pool processes import it.
"""

from __future__ import annotations

import zlib
from typing import Any

from rollstream.rewards import exact_match_reward

FAILING_SHARE = 8  # one prompt text in eight


class ChaosRewardError(RuntimeError):
    """Raised on purpose for the prompts chosen to fail."""


def fails(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % FAILING_SHARE == 0


def exact_match_or_fail(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                        **data: Any) -> float:
    if fails(prompt):
        raise ChaosRewardError("this prompt's reward fails on purpose (bench.chaos.rewards)")
    return exact_match_reward(prompt, completion, prompt_ids, completion_ids, **data)

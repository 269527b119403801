"""The engine and reward of the group-filter pipeline test (module-level: named by import string)."""

from __future__ import annotations

import random
from typing import Any

from rollstream.api.io_struct import ModelRequest
from rollstream.config import RolloutConfig
from rollstream.testing import ScriptedEngine

VOCAB = 300


def make_engine(config: RolloutConfig) -> ScriptedEngine:
    """An engine answering a few random tokens at once: the test is about groups, not models."""
    rng = random.Random(config.seed)

    def answer(req: ModelRequest) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 6))]

    return ScriptedEngine(answer, vocab_size=VOCAB)


def coin_reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    """0.5 for every sample of a ``constant`` prompt (a group that teaches nothing), else a random
    reward (distinct within a group)."""
    return 0.5 if data.get("constant") else random.random()

"""Which weights produced each token a stand-in server generated.

A token is known by its context (prompt and every token before it, then itself) and its
logprob; the stand-in's logprobs are exact in float32, so a tensor that travelled through an
episode still finds its entry. Tests look up every generated token of every episode and
compare the version the client tagged it with against the weights recorded here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TokenLedger:
    """``(context ending with the token, logprob) -> weight versions`` that produced it."""

    def __init__(self) -> None:
        self._entries: dict[tuple[tuple[int, ...], float], set[str]] = {}
        self.tokens = 0

    def record(self, context: Sequence[int], logprob: float, weight_version: str) -> None:
        self._entries.setdefault((tuple(context), _key(logprob)), set()).add(weight_version)
        self.tokens += 1

    def weights_of(self, context: Sequence[int], logprob: float) -> set[str]:
        """Every weight version that produced this token here (empty: never generated here)."""
        return self._entries.get((tuple(int(t) for t in context), _key(logprob)), set())


def _key(logprob: float) -> float:
    return float(np.float32(logprob))

"""The audit of every generated token's version tag by its logprob: recomputed with the weights
of the version it is tagged with (the tests on the real vLLM server).

Two ways a server treats running requests at a weight update, two recomputations:

* ``recomputed`` (``rollout.weight_update_mode: abort``): a request cut by the update is sent
  again and prefilled from scratch, so every token's logprob comes from one forward pass of the
  weights of its tag over its whole prefix;
* ``kept`` (``keep``): the request is frozen with its keys and values and goes on, so each
  position's keys and values come from the weights of the step that consumed it (the step that
  made the next generated token; the prompt's, the prefill that made the first one), and a
  token's logprob from the weights of its own step over that mixed cache. The audit replays
  exactly that: segment by segment, each version's model extends one cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM


# The audit's tolerance per dtype of the server and the recomputation (a token's logprob may
# differ by this much between two implementations of the same weights, not more):
# float32: measured 5e-7 between vLLM on CPU and transformers; bfloat16: measured at most 0.0020
# between vLLM on CPU and transformers, both bfloat16 (tests/integration/test_vllm_bf16.py), while
# the next version's weights differ by 0.156 at the median: 10x the measured figure.
TOLERANCES = {"float32": 1e-4, "bfloat16": 0.02}


@dataclass
class LogprobTagAudit:
    """Each generated token's logprob recomputed with the weights of the version it is tagged
    with: ``mistagged`` when they disagree (beyond the tolerance of the dtype, :data:`TOLERANCES`)."""

    rows: int = 0
    tokens: int = 0
    mistagged: int = 0
    rows_with_several_versions: int = 0
    versions: set[int] = field(default_factory=set)
    examples: list[str] = field(default_factory=list)
    max_error: float = 0.0  # the largest |logprob - recomputed| among the tokens within tolerance
    errors: list[float] = field(default_factory=list, repr=False)  # |logprob - recomputed| of every token
    rows_flagged: int = 0  # rows with at least one token beyond the tolerance

    def __str__(self) -> str:
        return (f"{self.rows} rows, {self.tokens} generated tokens of versions {sorted(self.versions)}: "
                f"{self.mistagged} mis-tagged; {self.rows_with_several_versions} rows span several versions")


class LogprobAuditor:
    """Audits rows (ids, loss mask, logprobs, versions) against checkpoints by version; ``kv``:
    how the server treated keys and values at an update (see the module docstring)."""

    def __init__(self, weights: Sequence[Path], temperature: float = 1.0, kv: str = "recomputed",
                 dtype: str = "float32") -> None:
        assert kv in ("recomputed", "kept"), kv
        self.weights = weights
        self.temperature = temperature
        self.kv = kv
        self.dtype = dtype  # the server's: the recomputation runs in it, and the tolerance follows it
        self.tolerance = TOLERANCES[dtype]
        self._models: dict[int, Any] = {}
        self.result = LogprobTagAudit()

    def model(self, version: int) -> Any:
        if version not in self._models:
            self._models[version] = AutoModelForCausalLM.from_pretrained(
                self.weights[version], dtype=getattr(torch, self.dtype)).eval()
        return self._models[version]

    def expected(self, ids: list[int], version: int) -> torch.Tensor:
        """The logprob of each token of ``ids`` after its prefix, with ``version``'s weights."""
        tensor = torch.tensor([ids])
        with torch.no_grad():
            logits = self.model(version)(tensor).logits[0].float() / self.temperature
        return torch.log_softmax(logits[:-1], -1).gather(1, tensor[0, 1:, None]).squeeze(1)

    def expected_kept(self, ids: list[int], generated: list[bool], versions: list[int]) -> torch.Tensor:
        """The logprob of each token of ``ids`` after its prefix, each position's keys and values
        from the weights of the step that consumed it (see the module docstring)."""
        consumer = [-1] * len(ids)  # the version of the step that consumed position p
        upcoming = -1
        for p in range(len(ids) - 1, 0, -1):
            if generated[p]:
                upcoming = versions[p]
            consumer[p - 1] = upcoming
        logits: list[torch.Tensor] = []
        cache: Any = None
        start = 0
        with torch.no_grad():
            while start < len(ids) - 1:
                end = start
                while end < len(ids) - 1 and consumer[end] == consumer[start]:
                    end += 1
                model = self.model(max(consumer[start], 0))
                out = model(torch.tensor([ids[start:end]]), cache=cache, use_cache=True)
                cache = out.cache
                logits.append(out.logits[0].float())
                start = end
        scaled = torch.cat(logits) / self.temperature
        return torch.log_softmax(scaled, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)

    def row(self, ids: list[int], generated: list[bool], logprobs: list[float], versions: list[int],
            where: str = "") -> None:
        result = self.result
        result.rows += 1
        tags = {versions[i] for i, g in enumerate(generated) if g}
        result.rows_with_several_versions += len(tags) > 1
        result.versions |= tags
        if self.kv == "kept":
            kept = self.expected_kept(ids, generated, versions)
            by_version = {v: kept for v in tags}
        else:
            by_version = {v: self.expected(ids, v) for v in tags}
        flagged = result.mistagged
        for i, g in enumerate(generated):
            if not g or i == 0:
                continue
            result.tokens += 1
            got, want = logprobs[i], float(by_version[versions[i]][i - 1])
            result.errors.append(abs(got - want))
            if abs(got - want) <= self.tolerance:
                result.max_error = max(result.max_error, abs(got - want))
            else:
                result.mistagged += 1
                if len(result.examples) < 10:
                    result.examples.append(f"{where} token {i}: tagged v{versions[i]}, logprob {got:.6f}, "
                                           f"that version's forward pass {want:.6f}")
        result.rows_flagged += result.mistagged > flagged

    def rows(self, rows: Iterable[tuple[list[int], list[bool], list[float], list[int], str]]) -> LogprobTagAudit:
        for row in rows:
            self.row(*row)
        return self.result

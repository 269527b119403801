"""LOAD GENERATOR — not a model. An ``InferenceEngine`` that emits tokens at a set rate.

It exists only in ``bench/`` to drive the pipeline without a GPU: every request gets
``min(completion budget, gconfig.budget(prompt_len))`` tokens (optionally a random share of it,
for mixed lengths), with made-up ids, logprobs and the engine's current version per token,
released at ``tokens_per_second`` across all requests together (a token bucket, as a GPU's
aggregate generation rate). ``tokens_per_second <= 0`` means "as fast as the CPU allows".

Nothing it generates means anything; it never reads ``stop_token_ids``. It honours
``pause``/``resume`` and ``update_weights`` (which only sets the version), so weight-version
plumbing downstream behaves as with a real engine.

A rollout worker uses it through configuration (``rollout.engine: custom``,
``rollout.engine_factory: bench.load_engine:make_engine``); the tier is otherwise unchanged.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

from rollstream.api.engine import InferenceEngine, WeightUpdate
from rollstream.api.io_struct import ModelRequest, ModelResponse
from rollstream.config import RolloutConfig

# Environment knobs, so a rollout-worker process using make_engine (below) can be configured.
ENV_RATE = "ROLLSTREAM_BENCH_TOKENS_PER_SECOND"
ENV_MIN_SHARE = "ROLLSTREAM_BENCH_MIN_LENGTH_SHARE"
ENV_VOCAB = "ROLLSTREAM_BENCH_VOCAB_SIZE"
ENV_SEED = "ROLLSTREAM_BENCH_SEED"

_POOL = 8192  # pre-drawn tokens and logprobs, sliced per request (keeps the generator cheap)


class LoadGeneratorEngine(InferenceEngine):
    """A LOAD GENERATOR posing as an inference engine (see the module docstring)."""

    def __init__(
        self,
        tokens_per_second: float = 0.0,
        min_length_share: float = 1.0,
        vocab_size: int = 512,
        seed: int = 0,
    ) -> None:
        if not 0.0 < min_length_share <= 1.0:
            raise ValueError("min_length_share must be in (0, 1]")
        self.tokens_per_second = tokens_per_second
        self.min_length_share = min_length_share
        self._rng = random.Random(seed)
        self._tokens = [self._rng.randrange(vocab_size) for _ in range(_POOL)]
        self._logprobs = [-self._rng.random() * 4.0 for _ in range(_POOL)]
        self._version = 0
        self._running = asyncio.Event()
        self._running.set()
        self._next_free = 0.0  # token bucket: when the engine has emitted everything reserved
        self.generated_tokens = 0
        self.requests = 0

    @classmethod
    def from_env(cls) -> LoadGeneratorEngine:
        """Configured by the ``ROLLSTREAM_BENCH_*`` environment variables (tier processes)."""
        return cls(
            tokens_per_second=float(os.environ.get(ENV_RATE, "0")),
            min_length_share=float(os.environ.get(ENV_MIN_SHARE, "1")),
            vocab_size=int(os.environ.get(ENV_VOCAB, "512")),
            seed=int(os.environ.get(ENV_SEED, "0")),
        )

    def _length(self, req: ModelRequest) -> int:
        budget = req.gconfig.budget(len(req.input_ids))
        if self.min_length_share >= 1.0:
            return budget
        return self._rng.randint(max(1, int(budget * self.min_length_share)), budget)

    async def _wait_for_tokens(self, n: int) -> None:
        if self.tokens_per_second <= 0:
            await asyncio.sleep(0)  # still yield: a real engine never answers synchronously
            return
        now = time.monotonic()
        self._next_free = max(self._next_free, now) + n / self.tokens_per_second
        await asyncio.sleep(self._next_free - now)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        await self._running.wait()
        started = time.monotonic()
        n = self._length(req)
        await self._wait_for_tokens(n)
        await self._running.wait()
        start = self._rng.randrange(_POOL - n) if n < _POOL else 0
        tokens = (self._tokens * (1 + n // _POOL))[start : start + n]
        logprobs = (self._logprobs * (1 + n // _POOL))[start : start + n]
        self.generated_tokens += n
        self.requests += 1
        latency = time.monotonic() - started
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=[self._version] * n,
            stop_reason="length",
            latency=latency,
            ttft=latency,
            tokenizer=req.tokenizer,
        )

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    async def pause(self) -> None:
        self._running.clear()

    async def resume(self) -> None:
        self._running.set()

    async def update_weights(self, update: WeightUpdate) -> None:
        self._version = update.version


def make_engine(config: RolloutConfig) -> LoadGeneratorEngine:
    """``rollout.engine_factory`` for ``rollout.engine: custom``: the load generator, configured by
    the ``ROLLSTREAM_BENCH_*`` environment variables (the rollout settings are not used)."""
    return LoadGeneratorEngine.from_env()

"""A per-episode view of the engine that remembers what the episode generated.

The worker hands each episode its own :class:`EpisodeEngine`, so concurrent episodes never
see each other's responses. After the workflow returns, ``last_response`` tells how the last
generation ended (the episode's stop reason) and ``output_tokens`` how many tokens it
generated (for metrics).
"""

from __future__ import annotations

from typing import Any

from rollstream.api.engine import InferenceEngine, WeightUpdate
from rollstream.api.io_struct import ModelRequest, ModelResponse


class EpisodeEngine(InferenceEngine):
    """Delegates to the shared engine and records every ``agenerate`` response.

    Attributes the workflow reads that this class does not define (e.g. a tokenizer the engine
    exposes) are looked up on the shared engine.
    """

    def __init__(self, inner: InferenceEngine) -> None:
        self.inner = inner
        self.responses: list[ModelResponse] = []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        resp = await self.inner.agenerate(req)
        self.responses.append(resp)
        return resp

    @property
    def last_response(self) -> ModelResponse | None:
        return self.responses[-1] if self.responses else None

    @property
    def stop_reason(self) -> str:
        """The last response's stop reason; "stop" when the episode generated nothing."""
        last = self.last_response
        return last.stop_reason if last is not None else "stop"

    @property
    def output_tokens(self) -> int:
        return sum(resp.output_len for resp in self.responses)

    def get_version(self) -> int:
        return self.inner.get_version()

    def set_version(self, version: int) -> None:
        self.inner.set_version(version)

    async def pause(self) -> None:
        await self.inner.pause()

    async def resume(self) -> None:
        await self.inner.resume()

    async def update_weights(self, update: WeightUpdate) -> None:
        await self.inner.update_weights(update)

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally; guard against recursion while
        # ``inner`` itself is not set yet (e.g. during copy or unpickling).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

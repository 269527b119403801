"""A per-episode view of the engine that remembers what the episode generated.

The rollout worker (and ``rollstream.testing``) hands each episode its own
:class:`EpisodeEngine`, so concurrent episodes never see each other's responses. After the
workflow returns, ``last_response`` tells how the last generation ended (the episode's stop
reason), ``output_tokens`` how many tokens it generated (for metrics), and ``responses`` let
the episode's result be matched to what the engine returned (``rollstream.trajectory.normalize``).
``image_data`` holds, per ``agenerate`` call in order, the images the request sent (a copy of
``ModelRequest.image_data``; ``[]`` for none): what the model saw, which the rollout worker
ships to the trainer side.

A training episode's requests must sample so that each token's logprob is the one the trainer
recomputes (:mod:`rollstream.engines.logprob_definition`): with ``training`` (the default), a
request that sets ``top_p``, ``top_k``, ``frequency_penalty`` or ``min_new_tokens`` is refused
before it reaches the engine. Eval episodes pass ``training=False``.
"""

from __future__ import annotations

from rollstream.api.engine import DelegatingEngine, InferenceEngine
from rollstream.api.io_struct import ModelRequest, ModelResponse
from rollstream.engines.logprob_definition import check_trainable


class EpisodeEngine(DelegatingEngine):
    """Delegates to the shared engine and records every ``agenerate`` response.

    Attributes the workflow reads that this class does not define (e.g. a tokenizer the engine
    exposes) are looked up on the shared engine.
    """

    def __init__(self, inner: InferenceEngine, training: bool = True) -> None:
        super().__init__(inner)
        self.training = training
        self.responses: list[ModelResponse] = []
        self.image_data: list[list[str]] = []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        if self.training:
            check_trainable(getattr(req, "gconfig", None))
        images = list(req.image_data or [])  # copied now: the workflow may reuse the request
        resp = await self.inner.agenerate(req)
        self.responses.append(resp)
        self.image_data.append(images)
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

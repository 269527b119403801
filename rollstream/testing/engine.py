"""A scripted ``InferenceEngine`` for workflow tests: no model, every answer chosen by the test.

:class:`ScriptedEngine` implements the whole engine contract the way real engines do:

* requests are checked and accepted like HF and SGLang do (``rollstream.engines.request_check``:
  AReaL's request types and a ``BatchEncoding`` are taken; text, nested lists, ids outside
  ``vocab_size``, a prompt that fills ``max_context`` raise ``InvalidRequestError``), and the budget is
  ``gconfig.budget(prompt_len)`` (capped by ``max_context``);
* outputs come from a list (cycled, one entry per call) or from a callable given the request
  (sync or async; raising makes ``agenerate`` raise, as a failing engine would); an entry is a
  token list or a :class:`Scripted` with its own logprobs, versions and stop reason;
* tokens are produced one at a time: each is tagged with the version current when it is
  produced (``set_version`` / ``update_weights``), ``pause`` holds generation at the next token
  until ``resume``, and ``token_delay`` spaces the tokens out so a test can pause mid-request;
* the stop reason is the scripted one (``"abort"`` and ``"tool_calls"`` included), else
  "length" when the budget cut the output, else "stop". Default logprobs: ``-0.5 - 0.1 * i``
  rounded to float32, as engines compute them (so they survive the trajectory's float32).

Every request (a copy, as sent) is kept in ``requests``; weight updates in ``weight_updates``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy

from rollstream.api.engine import InferenceEngine, WeightUpdate
from rollstream.api.io_struct import ModelRequest, ModelResponse, StopReason
from rollstream.engines.request_check import accepted_request


@dataclass(frozen=True)
class Scripted:
    """One scripted answer. ``logprobs``/``versions`` default to the engine's (see the module
    doc); given, they must have one entry per token."""

    tokens: Sequence[int]
    logprobs: Sequence[float] | None = None
    versions: Sequence[int] | None = None
    stop_reason: StopReason | None = None

    def __post_init__(self) -> None:
        for name in ("logprobs", "versions"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.tokens):
                raise ValueError(f"Scripted {name} has {len(values)} entries for {len(self.tokens)} tokens")


Answer = Union[Sequence[int], Scripted]
Script = Union[Sequence[Answer], Callable[[ModelRequest], Union[Answer, Awaitable[Answer]]]]


class ScriptedEngine(InferenceEngine):
    """See the module docstring. ``stop_reason`` applies to answers that set none; ``delay``
    is waited once per call, ``token_delay`` before each token."""

    def __init__(
        self,
        outputs: Script = ((10, 11, 2),),
        *,
        version: int = 0,
        stop_reason: StopReason | None = None,
        delay: float = 0.0,
        token_delay: float = 0.0,
        vocab_size: int | None = None,
        max_context: int | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.outputs = outputs if callable(outputs) else [_scripted(o) for o in outputs]
        if not callable(outputs) and not self.outputs:
            raise ValueError("ScriptedEngine needs at least one scripted output")
        self.version = version
        self.stop_reason = stop_reason
        self.delay = delay
        self.token_delay = token_delay
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.tokenizer = tokenizer
        self.requests: list[ModelRequest] = []
        self.weight_updates: list[WeightUpdate] = []
        self._unpaused = asyncio.Event()
        self._unpaused.set()

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        req = accepted_request(req, vocab_size=self.vocab_size, max_context=self.max_context)
        prompt = req.input_ids
        budget = req.gconfig.budget(len(prompt))
        if self.max_context is not None:
            budget = min(budget, self.max_context - len(prompt))
        self.requests.append(req.copy())
        answer = await self._answer(req)
        if self.delay:
            await asyncio.sleep(self.delay)
        tokens, versions = await self._produce(list(answer.tokens[:budget]), answer.versions)
        logprobs = list(answer.logprobs[: len(tokens)]) if answer.logprobs is not None else _default_logprobs(len(tokens))
        cut = len(tokens) < len(answer.tokens)
        return ModelResponse(
            input_tokens=prompt, output_tokens=tokens, output_logprobs=logprobs, output_versions=versions,
            stop_reason=answer.stop_reason or self.stop_reason or ("length" if cut else "stop"),
            latency=0.0, ttft=0.0, tokenizer=req.tokenizer, input_images=list(req.image_data or []),
            processor=req.processor,
        )

    async def _answer(self, req: ModelRequest) -> Scripted:
        if callable(self.outputs):
            answer = self.outputs(req)
            if inspect.isawaitable(answer):
                answer = await answer
            return _scripted(answer)
        return self.outputs[(len(self.requests) - 1) % len(self.outputs)]

    async def _produce(self, tokens: list[int], scripted: Sequence[int] | None) -> tuple[list[int], list[int]]:
        """The tokens one by one (waiting while paused), each with its version."""
        versions: list[int] = []
        for i in range(len(tokens)):
            await self._unpaused.wait()
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
                await self._unpaused.wait()
            versions.append(scripted[i] if scripted is not None else self.version)
        return tokens, versions

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    async def pause(self) -> None:
        self._unpaused.clear()

    async def resume(self) -> None:
        self._unpaused.set()

    async def update_weights(self, update: WeightUpdate) -> None:
        self.weight_updates.append(update)
        self.version = update.version


def _default_logprobs(n: int) -> list[float]:
    values = numpy.float32(-0.5) - numpy.float32(0.1) * numpy.arange(n, dtype=numpy.float32)
    return [float(v) for v in values]


def _scripted(answer: Answer) -> Scripted:
    if isinstance(answer, Scripted):
        return answer
    return Scripted(tokens=[int(t) for t in answer])

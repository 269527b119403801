"""Requests, responses and sampling settings exchanged between workflows and engines.

These mirror AReaL's contracts so that existing workflows port unchanged:
``ModelRequest`` and ``ModelResponse`` have every field AReaL's have (``areal.api.io_struct``,
AReaL 1.0.4), and ``ModelResponse`` its ``end_with_stop`` and ``output_tokens_without_stop``.
Engines also take AReaL's own request and settings objects (``rollstream.engines.request_check``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Protocol

StopReason = Literal["stop", "length", "tool_calls", "abort"]


class TokenizerLike(Protocol):
    """The two attributes of a tokenizer that generation settings need."""

    pad_token_id: int | None
    eos_token_id: int | None


TOP_K_OFF = int(1e8)  # GenerationHyperparameters' "no top-k" default (AReaL's)


def top_k_is_on(top_k: int) -> bool:
    """Whether ``top_k`` keeps fewer tokens than all: ``<= 0`` and ``>= TOP_K_OFF`` mean off."""
    return 0 < top_k < TOP_K_OFF


@dataclass
class GenerationHyperparameters:
    """Sampling settings for one request. Defaults follow AReaL.

    ``top_k`` of 1e8 means "off"; engines treat ``top_k <= 0`` or ``>= vocab`` as off too.
    The generation budget is ``min(max_tokens - prompt_len, max_new_tokens)``.
    """

    n_samples: int = 1
    max_new_tokens: int = 16384
    min_new_tokens: int = 0
    max_tokens: int = 32768
    greedy: bool = False
    top_p: float = 1.0
    top_k: int = TOP_K_OFF
    temperature: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop: list[str] | None = None
    frequency_penalty: float = 0.0

    def new(self, **kwargs: Any) -> GenerationHyperparameters:
        """A copy with ``kwargs`` replaced; unknown names raise ``TypeError``."""
        known = {f.name for f in fields(self)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown generation settings: {sorted(unknown)}")
        stop_ids = kwargs.pop("stop_token_ids", self.stop_token_ids)
        return replace(self, stop_token_ids=list(stop_ids), **kwargs)

    def new_with_stop_and_pad_token_ids(self, tokenizer: TokenizerLike) -> GenerationHyperparameters:
        """A copy whose stop ids also hold the tokenizer's pad id, then its eos id."""
        stop_ids = list(self.stop_token_ids)
        for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
            if token_id is not None and token_id not in stop_ids:
                stop_ids.append(token_id)
        return self.new(stop_token_ids=stop_ids)

    def budget(self, prompt_len: int) -> int:
        """Tokens that may still be generated for a prompt of ``prompt_len`` tokens.

        Raises ``ValueError`` when the prompt leaves no room to generate.
        """
        budget = min(self.max_tokens - prompt_len, self.max_new_tokens)
        if budget <= 0:
            raise ValueError(
                f"no generation budget: prompt has {prompt_len} tokens, max_tokens="
                f"{self.max_tokens}, max_new_tokens={self.max_new_tokens}"
            )
        return budget


@dataclass
class ModelRequest:
    """One generation request. ``rid`` keeps retries and resumptions on the same server."""

    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    input_ids: list[int] = field(default_factory=list)
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    metadata: dict[str, Any] = field(default_factory=dict)
    image_data: list[str] | None = None
    tokenizer: Any = None
    processor: Any = None  # a VLM's processor, handed back on the response
    vision_msg_vllm: list[Any] | None = None  # AReaL's vLLM-only chat form; engines here ignore it

    def copy(self) -> ModelRequest:
        return replace(
            self,
            input_ids=list(self.input_ids),
            gconfig=self.gconfig.new(),
            metadata=dict(self.metadata),
            image_data=None if self.image_data is None else list(self.image_data),
            vision_msg_vllm=None if self.vision_msg_vllm is None else list(self.vision_msg_vllm),
        )


@dataclass
class ModelResponse:
    """The engine's answer: output tokens with one logprob and one weight version each.

    ``stop_reason`` is one of stop | length | tool_calls | abort. An engine that was
    interrupted by a weight update resumes internally; a final abort is reported as length.
    ``tokenizer``, ``processor`` and ``input_images`` are the request's (``image_data``);
    ``itl`` (inter-token latencies) and ``routed_experts`` (MoE routing) are left empty here.
    """

    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stop_reason: StopReason = "stop"
    latency: float = float("inf")
    ttft: float = float("inf")
    tokenizer: Any = None
    input_images: list[Any] = field(default_factory=list)
    processor: Any = None
    itl: list[float] = field(default_factory=list)
    routed_experts: Any = None

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)

    def _stop_ids(self, what: str) -> set[int]:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs the tokenizer: pass tokenizer= in the ModelRequest")
        return {t for t in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id) if t is not None}

    @property
    def end_with_stop(self) -> bool:
        """True when the last output token is the tokenizer's eos or pad token (``ValueError``
        without a tokenizer)."""
        stops = self._stop_ids("end_with_stop")
        return bool(self.output_tokens) and self.output_tokens[-1] in stops

    @property
    def output_tokens_without_stop(self) -> list[int]:
        """The output without its trailing eos/pad tokens when generation stopped on one.

        For "length" and "abort" (and an empty output) the output as is. ``ValueError`` when a
        finished output does not end with eos/pad, or is nothing but eos/pad tokens.
        """
        stops = self._stop_ids("output_tokens_without_stop")
        if self.stop_reason in ("length", "abort") or not self.output_tokens:
            return self.output_tokens
        end = len(self.output_tokens)
        while end and self.output_tokens[end - 1] in stops:
            end -= 1
        if end == len(self.output_tokens):
            raise ValueError(
                f"stop_reason is {self.stop_reason!r} but the output ends with token "
                f"{self.output_tokens[-1]}, neither the eos nor the pad token"
            )
        if end == 0:
            raise ValueError("the output is only eos/pad tokens: nothing is left without them")
        return self.output_tokens[:end]

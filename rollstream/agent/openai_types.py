"""The OpenAI chat completions wire shapes the agent endpoint reads and writes (msgspec Structs).

:class:`ChatCompletionRequest` is the request body; decoding it with :func:`decode_request`
checks every field (``RequestError`` naming the path, e.g. ``Expected `int` >= 1 - at `$.n```).
Fields the endpoint cannot honour are refused when set to anything but their neutral value
(``presence_penalty``, ``logit_bias``, ``top_logprobs``, a ``response_format`` other than
text); fields with no effect on generation (``user``, ``metadata``, ``store``, ``seed``,
``parallel_tool_calls``, ``service_tier``, ``reasoning_effort``) are accepted and ignored; any
other field is refused, so a client never believes a setting was applied when it was not.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from rollstream.agent.messages import RequestError

Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    messages: list[Any]
    model: str = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    stop: str | list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=0)] | None = None  # only the sampled token's
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=0.0, le=0.0)] | None = None  # not supported
    logit_bias: Annotated[dict[str, float], msgspec.Meta(max_length=0)] | None = None  # not supported
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template (vLLM/SGLang's extension)
    # No effect on generation; accepted so that common clients work unchanged.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    seed: int | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None


class RewardRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``POST {base_url}/rewards``: the reward of one completion (default: the last one)."""

    reward: float
    completion_id: str | None = None


_request_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_reward_decoder = msgspec.json.Decoder(RewardRequest)


def decode_request(body: bytes) -> ChatCompletionRequest:
    """The request in ``body``, checked (see the module docstring); ``RequestError`` if not."""
    try:
        request = _request_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise RequestError(_unsupported_hint(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    if request.response_format is not None and request.response_format.get("type", "text") != "text":
        raise RequestError("response_format other than {'type': 'text'} is not supported", "response_format")
    if isinstance(request.tool_choice, str) and request.tool_choice not in ("none", "auto", "required"):
        raise RequestError(f"tool_choice {request.tool_choice!r} is not one of none, auto, required", "tool_choice")
    return request


def decode_reward(body: bytes) -> RewardRequest:
    try:
        return _reward_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RequestError(f"expected {{'reward': <number>, 'completion_id': <id, optional>}}: {exc}") from None


def _unsupported_hint(message: str) -> str:
    for field, why in (
        ("top_logprobs", "only the sampled token's logprob is reported (top_logprobs must be 0)"),
        ("presence_penalty", "presence_penalty is not supported (use frequency_penalty)"),
        ("logit_bias", "logit_bias is not supported"),
    ):
        if f"$.{field}" in message:
            return f"{message}: {why}"
    if "unknown field" in message:
        return f"{message}: the endpoint refuses settings it does not apply (docs/WORKFLOWS.md, the agent endpoint)"
    return message


# ---- responses ---------------------------------------------------------------------------------


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[Any] = msgspec.field(default_factory=list)


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


FinishReason = Literal["stop", "length", "tool_calls"]


class Choice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: str = "chat.completion"


class ToolCallDelta(msgspec.Struct):
    index: int
    id: str
    function: FunctionCall
    type: str = "function"


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ModelCard(msgspec.Struct):
    id: str
    created: int = 0
    owned_by: str = "rollstream"
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail

"""One chat completion request of a session: prompt tokens, generation, reply, turns.

:func:`create_completion` is the endpoint's work for ``POST /v1/chat/completions`` without
the HTTP. Callers may rely on:

* The prompt is token ids made here with the model's chat template, never text sent to the
  engine; when the request extends an earlier turn of the session
  (``rollstream.agent.conversation``) the prompt is that turn's exact prompt + output tokens
  followed by the new tokens only.
* ``n`` choices are ``n`` engine requests on the same prompt, each its own turn.
* Request settings override the worker's generation settings: ``max_completion_tokens`` /
  ``max_tokens`` (the smaller when both) -> ``max_new_tokens``, ``temperature`` (0 = greedy),
  ``top_p``, ``frequency_penalty``, ``stop``. Generation also stops at the template's
  end-of-turn token.
* The reply's content is the generated text without special tokens, cut before the first
  ``stop`` string; with ``tools`` (and ``tool_choice`` other than "none") tool calls are parsed
  from it (``rollstream.agent.tool_calls``) and ``finish_reason`` is "tool_calls".
  ``tool_choice`` "required" or naming a function is not enforced: the model's output is
  returned as generated.
* ``logprobs`` lists every generated token (the end-of-turn token included) with the
  engine's logprob of it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Any

from rollstream.agent.chat_template import ChatRenderer
from rollstream.agent.conversation import Turn
from rollstream.agent.messages import (
    MessageKey, RequestError, clean_messages, message_key, settings_key,
)
from rollstream.agent.openai_types import (
    ChatCompletion, ChatCompletionRequest, ChatMessage, Choice, ChoiceLogprobs, FinishReason, FunctionCall,
    TokenLogprob, ToolCall, Usage,
)
from rollstream.agent.session import AgentSession
from rollstream.agent.tool_calls import parse_tool_calls
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.runtime.tasks import cancel_and_wait


def generation_settings(
    defaults: GenerationHyperparameters, request: ChatCompletionRequest, turn_end_ids: Sequence[int],
) -> GenerationHyperparameters:
    """The worker's settings with the request's overrides (see the module docstring)."""
    limits = [v for v in (request.max_tokens, request.max_completion_tokens) if v is not None]
    settings: dict[str, Any] = {
        "n_samples": 1,
        "max_new_tokens": min(limits) if limits else defaults.max_new_tokens,
        "stop_token_ids": list(dict.fromkeys([*defaults.stop_token_ids, *turn_end_ids])),
    }
    if request.temperature is not None:
        settings["temperature"] = request.temperature
        settings["greedy"] = request.temperature == 0
    if request.top_p is not None:
        settings["top_p"] = request.top_p
    if request.frequency_penalty is not None:
        settings["frequency_penalty"] = request.frequency_penalty
    if request.stop is not None:
        settings["stop"] = [request.stop] if isinstance(request.stop, str) else list(request.stop)
    return defaults.new(**settings)


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    """The function names of ``tools``; ``RequestError`` for a tool that is not a function."""
    names = set()
    for i, tool in enumerate(tools or []):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", f"tools[{i}]")
        names.add(function["name"])
    return names


async def create_completion(session: AgentSession, request: ChatCompletionRequest) -> ChatCompletion:
    """Answer ``request`` for ``session`` and record its turns (see the module docstring)."""
    renderer = session.settings.renderer
    if renderer is None:
        raise RuntimeError(session.settings.no_chat_reason)
    messages = clean_messages(request.messages)
    names = tool_names(request.tools)
    settings = settings_key(request.tools, request.chat_template_kwargs)
    history = [message_key(m) for m in messages]
    parent, new_prompt = _prompt(session, renderer, messages, history, request, settings)
    prompt = (parent.full_ids if parent is not None else []) + new_prompt
    gconfig = generation_settings(session.settings.defaults, request, renderer.turn_end_ids)
    responses = await _generate(session, prompt, gconfig, renderer.tokenizer, request.n)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    parse = names if request.tools and request.tool_choice != "none" else set()
    choices, turns = [], []
    for index, resp in enumerate(responses):
        message, finish = _reply(renderer, resp, gconfig.stop or [], parse)
        choices.append(Choice(index=index, message=message, finish_reason=finish,
                              logprobs=_logprobs(renderer, resp) if request.logprobs else None))
        turns.append(Turn(
            completion_id=completion_id, choice=index, new_prompt=new_prompt, response=resp, parent=parent,
            history=[*history, message_key(_as_dict(message))], settings=settings,
        ))
    session.record(turns)
    completion_tokens = sum(r.output_len for r in responses)
    return ChatCompletion(
        id=completion_id, created=int(time.time()), model=request.model or session.settings.model_name,
        choices=choices, usage=Usage(len(prompt), completion_tokens, len(prompt) + completion_tokens),
    )


def _prompt(
    session: AgentSession, renderer: ChatRenderer, messages: list[dict[str, Any]], history: list[MessageKey],
    request: ChatCompletionRequest, settings: str,
) -> tuple[Turn | None, list[int]]:
    """``(parent, tokens to add after the parent's)``; no parent: the whole prompt."""
    parent = session.conversation.parent_for(history, settings)
    if parent is not None and parent.history is not None:
        at = len(parent.history)
        new = renderer.continuation_ids(
            messages[:at], messages[at:], parent.response.output_tokens, request.tools, request.chat_template_kwargs,
        )
        if new is not None:
            return parent, new
    return None, renderer.prompt_ids(messages, request.tools, request.chat_template_kwargs)


async def _generate(
    session: AgentSession, prompt: list[int], gconfig: GenerationHyperparameters, tokenizer: Any, n: int,
) -> list[ModelResponse]:
    """``n`` generations of ``prompt``; the first failure cancels the others and is raised."""
    requests = [ModelRequest(input_ids=list(prompt), gconfig=gconfig.new(), tokenizer=tokenizer) for _ in range(n)]
    tasks = [asyncio.ensure_future(session.run(session.generator.agenerate(r))) for r in requests]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await cancel_and_wait(*tasks)
        raise


def _reply(
    renderer: ChatRenderer, resp: ModelResponse, stops: Sequence[str], tools: set[str],
) -> tuple[ChatMessage, FinishReason]:
    text = renderer.decode(resp.output_tokens, skip_special_tokens=True)
    cuts = [at for at in (text.find(s) for s in stops) if at >= 0]
    if cuts:
        text = text[: min(cuts)]  # the OpenAI API leaves the stop string out of the content
    finish: FinishReason = "length" if resp.stop_reason == "length" else "stop"
    content, calls = parse_tool_calls(text, tools) if tools else (text, [])
    if not calls:
        return ChatMessage(role="assistant", content=content), finish
    tool_calls = [ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(c.name, c.arguments)) for c in calls]
    return ChatMessage(role="assistant", content=content, tool_calls=tool_calls), "tool_calls"


def _as_dict(message: ChatMessage) -> dict[str, Any]:
    calls = [{"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for c in message.tool_calls or []]
    return {"role": message.role, "content": message.content, "tool_calls": calls}


def _logprobs(renderer: ChatRenderer, resp: ModelResponse) -> ChoiceLogprobs:
    entries = []
    for token, logprob in zip(resp.output_tokens, resp.output_logprobs):
        text = renderer.decode([token], skip_special_tokens=False)
        entries.append(TokenLogprob(token=text, logprob=float(logprob), bytes=list(text.encode("utf-8"))))
    return ChoiceLogprobs(content=entries)

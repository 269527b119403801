"""Chat messages as an agent sends them: cleaned for the chat template, keyed for comparison.

:func:`clean_messages` turns a request's ``messages`` into plain dicts a Hugging Face chat
template can render, or raises :class:`RequestError` naming the bad message. Callers may rely
on:

* roles are system, user, assistant or tool (``developer`` is taken as system);
* ``content`` is a string (text parts of a list joined; ``None`` kept only for an assistant
  message with tool calls); any non-text part (an image, audio) is refused;
* an assistant's ``tool_calls`` are ``{"id", "type": "function", "function": {"name",
  "arguments"}}`` with ``arguments`` a mapping when the JSON string holds an object (what
  chat templates expect), else the string as sent;
* keys whose value is ``None`` are dropped, other keys (``name``, ``tool_call_id``) kept.

:func:`message_key` is what "the same message" means when a request is matched against an
earlier turn: role, content (``None`` = ""), and each tool call's name and arguments (JSON
compared as values, so key order and spacing do not matter); tool call ids and other fields
are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

ROLES = frozenset({"system", "user", "assistant", "tool"})
MessageKey = tuple[str, str, tuple[tuple[str, str], ...]]


class RequestError(ValueError):
    """A request the endpoint refuses (HTTP 400); ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def clean_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's ``messages`` ready for the chat template (see the module docstring)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise RequestError("messages must be a non-empty list of message objects", "messages")
    return [_clean(message, i) for i, message in enumerate(messages)]


def _clean(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise RequestError(f"{where} must be an object, got {type(message).__name__}", where)
    role = message.get("role")
    role = "system" if role == "developer" else role
    if role not in ROLES:
        raise RequestError(f"{where}.role is {role!r}; expected one of {sorted(ROLES | {'developer'})}", f"{where}.role")
    cleaned = {key: value for key, value in message.items() if value is not None}
    cleaned["role"] = role
    tool_calls = cleaned.pop("tool_calls", None)
    if tool_calls and role == "assistant":
        cleaned["tool_calls"] = [_clean_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(tool_calls)]
    content = _text(message.get("content"), f"{where}.content")
    if content is None and not cleaned.get("tool_calls"):
        content = ""
    if content is not None:
        cleaned["content"] = content
    return cleaned


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    f"{where}[{i}] is a {kind or type(part).__name__!s} part; only text content is supported", where
                )
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where} must be a string or a list of text parts, got {type(content).__name__}", where)


def _clean_tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise RequestError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    arguments = function.get("arguments", "{}")
    cleaned = {"type": "function", "function": {"name": function["name"], "arguments": _arguments_value(arguments)}}
    if call.get("id") is not None:
        cleaned["id"] = call["id"]
    return cleaned


def _arguments_value(arguments: Any) -> Any:
    """A JSON object string as a mapping (chat templates render mappings); else as given."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def _canonical_arguments(arguments: Any) -> str:
    value = _arguments_value(arguments)
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def message_key(message: Mapping[str, Any]) -> MessageKey:
    """What identifies ``message`` (cleaned or as returned) when conversations are matched."""
    calls = tuple(
        (call["function"]["name"], _canonical_arguments(call["function"].get("arguments", "{}")))
        for call in message.get("tool_calls") or ()
    )
    return (message["role"], message.get("content") or "", calls)


def settings_key(tools: Any, template_kwargs: Mapping[str, Any] | None) -> str:
    """Tools and chat-template arguments as one string: turns extend each other only when
    their prompts were rendered with the same ones."""
    return json.dumps({"tools": tools, "template": dict(template_kwargs or {})}, sort_keys=True, default=str)

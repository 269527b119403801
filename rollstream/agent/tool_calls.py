"""Tool calls in a model's output text, in the Hermes / Qwen format most chat templates use.

A call is a ``<tool_call>`` block holding one JSON object with a ``name`` and ``arguments``::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3+4"}}
    </tool_call>

:func:`parse_tool_calls` finds every complete block whose JSON parses and names one of the
request's tools; those become tool calls (``arguments`` as a JSON string, as the OpenAI API
returns them) and are cut out of the text. Anything else, including a block cut off by the
token budget, malformed JSON or an unknown tool name, stays in the content as the model wrote
it, so nothing the model produced is hidden from the agent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON string


def parse_tool_calls(text: str, tool_names: Collection[str]) -> tuple[str | None, list[ParsedToolCall]]:
    """``(content, calls)`` for ``text``. Without calls the content is ``text`` unchanged; with
    calls it is the remaining text, stripped, or ``None`` when nothing remains."""
    calls: list[ParsedToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = _parse_block(match.group(1), tool_names)
        if call is None:
            continue
        kept.append(text[position:match.start()])
        position = match.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[position:])
    content = "".join(kept).strip()
    return content or None, calls


def _parse_block(body: str, tool_names: Collection[str]) -> ParsedToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in tool_names:
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ParsedToolCall(name=value["name"], arguments=arguments)

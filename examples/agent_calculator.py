"""An agent as users write them: the plain ``openai`` client, a multi-turn loop, one tool.

The task is the demo's (``{"prompt": "3+4=", "answer": "7"}``). The model may call a
``calculator`` tool (with an expression, or without one to evaluate the question); the agent
runs it and sends the result back, until the model answers without a tool call (or
``max_turns`` model calls were made). The reward is 1.0 when the final answer is the
expected one, else 0.0.

Nothing here knows about rollstream: ``run`` receives ``base_url``, ``api_key`` and
``http_client`` (the rollout worker's OpenAI-compatible endpoint, one session per episode)
and the same code runs against any OpenAI-compatible server. Register it in the rollout
worker's allow-list::

    rollout:
      workflows:
        calculator_agent:
          path: examples.agent_calculator:CalculatorAgent
          kwargs: {max_turns: 3, max_tokens: 48}
      default_workflow: calculator_agent
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

from openai import AsyncOpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer expression (+ - * and parentheses), e.g. 3+4; without one, the question.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_EXPRESSION_CHARS = 64


def calculate(expression: str) -> str:
    """The value of an integer expression (``+ - *``, parentheses), or ``"error: ..."``."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return "error: expression too long"
    try:
        return str(_evaluate(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError) as exc:
        return f"error: {exc}"


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"unsupported: {ast.dump(node)[:40]}")


def run_tool(name: str, arguments: str, question: str = "") -> str:
    """The result of one tool call, as the text the model sees. Without an ``expression`` the
    calculator evaluates the question (a tool that knows the task, as many agents' tools do)."""
    if name != "calculator":
        return f"error: unknown tool {name}"
    try:
        expression = json.loads(arguments or "{}").get("expression") or question.rstrip("= ")
    except (ValueError, AttributeError):
        return "error: arguments must be {} or {\"expression\": \"...\"}"
    return calculate(str(expression))


class CalculatorAgent:
    """Answers ``data["prompt"]``, calling the calculator when the model asks to."""

    def __init__(self, max_turns: int = 3, max_tokens: int = 48, temperature: float = 1.0) -> None:
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.temperature = temperature

    async def run(self, data: dict[str, Any], **extra: Any) -> float:
        client = AsyncOpenAI(
            base_url=extra["base_url"], api_key=extra["api_key"], http_client=extra.get("http_client"), max_retries=0,
        )
        messages: list[Any] = [{"role": "user", "content": data["prompt"]}]
        answer = ""
        for _ in range(self.max_turns):
            completion = await client.chat.completions.create(
                model="default", messages=messages, tools=[CALCULATOR],
                max_tokens=self.max_tokens, temperature=self.temperature,
            )
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                answer = message.content or ""
                break
            for call in message.tool_calls:
                result = run_tool(call.function.name, call.function.arguments, data["prompt"])
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return 1.0 if answer.strip() == str(data["answer"]).strip() else 0.0

"""Chat messages to prompt token ids, with the model's own chat template, for the agent endpoint.

:class:`ChatRenderer` wraps the worker's tokenizer. Callers may rely on:

* :meth:`ChatRenderer.prompt_ids` is what ``apply_chat_template(messages, tools=...,
  add_generation_prompt=True, tokenize=True)`` gives: the template's text, encoded without
  added special tokens.
* :meth:`ChatRenderer.continuation_ids` is the token ids to append to an earlier turn's exact
  prompt + output tokens when a request's messages extend that turn: the end of the
  assistant's turn the model did not write itself (``"\\n"`` after ``<|im_end|>``, or the whole
  turn closing when generation was cut off), then the new messages and the generation prompt,
  as the template renders them after that history. ``None`` when the template does not render
  the history as a prefix of the longer conversation (e.g. one that drops earlier reasoning):
  such a turn cannot extend the earlier one and starts a row of its own.
* :attr:`ChatRenderer.turn_end_ids` are the special tokens that end an assistant turn in this
  template (``<|im_end|>`` for Qwen-style templates): the endpoint stops generation on them.
* Template errors (a template that raises, or has none) are :class:`RequestError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollstream.agent.messages import RequestError

_SENTINEL = "\u2063rollstream-sentinel\u2063"  # text no template rewrites and no one sends


class ChatRenderer:
    """Renders chat messages with ``tokenizer``'s chat template (see the module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError(
                "the model's tokenizer has no chat template, so chat messages cannot be turned into "
                "a prompt: use a tokenizer with one (rollout.tokenizer_path)"
            )
        self.tokenizer = tokenizer
        self.closing = self._assistant_closing()
        self.turn_end_ids = self._turn_end_ids()

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None, *, generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The template's text for ``messages``; :class:`RequestError` when the template fails."""
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tools=tools or None, add_generation_prompt=generation_prompt,
                tokenize=False, **dict(template_kwargs or {}),
            )
        except Exception as exc:  # jinja's errors (raise_exception in templates included)
            raise RequestError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from exc
        return text if isinstance(text, str) else str(text)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def prompt_ids(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        return self.encode(self.render(messages, tools, generation_prompt=True, template_kwargs=template_kwargs))

    def continuation_ids(
        self, history: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]], output_ids: Sequence[int],
        tools: Any = None, template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int] | None:
        """Tokens after an earlier turn whose messages + reply are ``history`` and whose model
        output was ``output_ids``, for a request of ``history + new`` (see the module doc)."""
        before = self.render(history, tools, generation_prompt=False, template_kwargs=template_kwargs)
        after = self.render([*history, *new], tools, generation_prompt=True, template_kwargs=template_kwargs)
        if not after.startswith(before):
            return None
        return self.encode(self.unwritten_closing(output_ids) + after[len(before):])

    def unwritten_closing(self, output_ids: Sequence[int]) -> str:
        """The part of the assistant turn's closing text the model did not generate: the
        closing minus its longest prefix the output already ends with."""
        text = self.decode(output_ids, skip_special_tokens=False)
        for size in range(len(self.closing), 0, -1):
            if text.endswith(self.closing[:size]):
                return self.closing[size:]
        return self.closing

    def _assistant_closing(self) -> str:
        """The text the template puts after an assistant message's content (``<|im_end|>\\n``)."""
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
        text = self.render(messages, generation_prompt=False)
        at = text.rfind(_SENTINEL)
        return "" if at < 0 else text[at + len(_SENTINEL):]

    def _turn_end_ids(self) -> list[int]:
        """The closing's first token when it is a special token (an end-of-turn marker)."""
        ids = self.encode(self.closing) if self.closing else []
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        special |= {int(i) for i in (getattr(self.tokenizer, "added_tokens_decoder", None) or {})}
        return [ids[0]] if ids and ids[0] in special else []

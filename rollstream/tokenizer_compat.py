"""The tokenizer workflows receive: ``apply_chat_template`` returns token ids, as workflows expect.

Workflows written for the reference system call
``tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)`` and use
the result as a list of token ids, which is what transformers 4 returned. transformers 5
returns a ``BatchEncoding`` there instead (``list()`` of it is its keys), so such a workflow
sends ``['input_ids', 'attention_mask']`` to the engine. DECISION: the tokenizer rollstream
hands to workflows (``"$tokenizer"`` in ``rollout.workflows``, ``rollstream.testing``) keeps
the transformers 4 default: ``return_dict`` is False unless the caller passes it. Every other
call, and every call that passes ``return_dict``, behaves exactly as transformers defines it.
Engines still refuse a ``BatchEncoding`` with a message saying so (see
``rollstream.api.request_check``), for tokenizers a workflow loads itself.
"""

from __future__ import annotations

import inspect
from typing import Any


def ids_from_chat_template(tokenizer: Any) -> Any:
    """``tokenizer`` itself, its ``apply_chat_template`` defaulting to ``return_dict=False``.

    A tokenizer whose ``apply_chat_template`` has no ``return_dict`` parameter (transformers
    before 4.44), or none at all, is returned unchanged. Idempotent.
    """
    method = getattr(type(tokenizer), "apply_chat_template", None)
    if method is None or "return_dict" not in inspect.signature(method).parameters:
        return tokenizer
    if not isinstance(vars(tokenizer).get("apply_chat_template"), _IdsByDefault):
        tokenizer.apply_chat_template = _IdsByDefault(tokenizer)
    return tokenizer


class _IdsByDefault:
    """The tokenizer class's ``apply_chat_template`` with ``return_dict=False`` by default.

    A plain object holding its tokenizer (not a bound method), so the tokenizer still pickles
    and deep-copies.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("return_dict", False)
        return type(self.tokenizer).apply_chat_template(self.tokenizer, *args, **kwargs)

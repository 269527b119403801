"""Checking a request's ``input_ids`` before any engine sends it to a model.

Every engine calls :func:`checked_input_ids` first, so a malformed request fails alone, with a
message that names the likely cause, instead of failing the engine step it would have shared
with other requests (one bad row fails a whole batched forward pass).

Accepted: a flat, non-empty sequence of integers (Python ints, numpy or torch integer scalars,
or a 1-D integer tensor or array), each inside the model's vocabulary when the engine knows
its size, and shorter than the model's context when the engine knows it. Everything else
raises :class:`InvalidRequestError`.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

# What list(BatchEncoding) yields: its keys. A request whose "ids" are these strings came from
# ``list(tokenizer.apply_chat_template(..., tokenize=True))`` in transformers 5.
_ENCODING_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "position_ids"})
_BATCH_ENCODING_HINT = (
    "apply_chat_template (and tokenizer(...)) return a BatchEncoding in transformers 5; "
    "pass return_dict=False, or take ['input_ids']"
)


class InvalidRequestError(ValueError):
    """A request an engine refuses before generating: the message says what and how to fix it."""


def checked_input_ids(
    input_ids: Any, *, vocab_size: int | None = None, max_context: int | None = None
) -> list[int]:
    """``input_ids`` as a list of ints, or :class:`InvalidRequestError` (see the module doc).

    ``max_context``: the most tokens the model can attend to; the prompt must leave room for
    at least one generated token.
    """
    ids = _as_int_list(input_ids)
    if not ids:
        raise InvalidRequestError("input_ids is empty: a request needs at least one prompt token")
    if vocab_size is not None:
        _check_vocabulary(ids, vocab_size)
    if max_context is not None and len(ids) >= max_context:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens but the model's context holds {max_context} "
            f"(max_position_embeddings), leaving no room to generate; shorten or truncate the prompt"
        )
    return ids


def _as_int_list(input_ids: Any) -> list[int]:
    if isinstance(input_ids, Mapping):
        if "input_ids" in input_ids:
            raise InvalidRequestError(f"input_ids is a {type(input_ids).__name__}, not token ids: {_BATCH_ENCODING_HINT}")
        raise InvalidRequestError(f"input_ids is a {type(input_ids).__name__} with keys {sorted(map(str, input_ids))[:5]}; expected a list of token ids")
    if isinstance(input_ids, (str, bytes)):
        raise InvalidRequestError(
            "input_ids is text, not token ids: tokenize it first (tokenizer.encode(text), or "
            "apply_chat_template(messages, tokenize=True, return_dict=False))"
        )
    shape = getattr(input_ids, "shape", None)
    if shape is not None and len(shape) != 1:  # a tensor or array
        raise InvalidRequestError(
            f"input_ids has shape {list(shape)}; expected one prompt as a flat list of token ids "
            "(for a [1, L] tensor pass tensor[0].tolist())"
        )
    if not isinstance(input_ids, Sequence) and shape is None:
        raise InvalidRequestError(f"input_ids is a {type(input_ids).__name__}; expected a list of token ids")
    values = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
    return [_as_token(value, i, values) for i, value in enumerate(values)]


def _as_token(value: Any, index: int, values: list[Any]) -> int:
    if isinstance(value, str):
        if set(values) <= _ENCODING_KEYS:
            raise InvalidRequestError(
                f"input_ids is {values!r}: the keys of a BatchEncoding, not token ids; {_BATCH_ENCODING_HINT}"
            )
        raise InvalidRequestError(f"input_ids[{index}] is the string {value[:40]!r}; expected token ids (integers): tokenize the text first")
    if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0):
        raise InvalidRequestError(
            f"input_ids[{index}] is a sequence: input_ids is nested (a batch of prompts?); send one "
            "prompt per request as a flat list of token ids"
        )
    if isinstance(value, bool):
        raise InvalidRequestError(f"input_ids[{index}] is a bool (an attention mask?); expected token ids (integers)")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidRequestError(
            f"input_ids[{index}] is {value!r} ({type(value).__name__}); expected token ids (integers)"
        ) from None


def _check_vocabulary(ids: list[int], vocab_size: int) -> None:
    if min(ids) >= 0 and max(ids) < vocab_size:
        return
    for index, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"input_ids[{index}] = {token} is outside the model's vocabulary (ids 0..{vocab_size - 1}); "
                "was the prompt tokenized with another model's tokenizer?"
            )

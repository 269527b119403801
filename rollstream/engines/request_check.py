"""What an engine accepts as a request, checked before any engine sends it to a model.

Every engine calls :func:`accepted_request` first, so a malformed request fails alone, with a
message that names the likely cause, instead of failing the decode pass it would have shared
with other requests (one bad row fails a whole batched forward pass).

**Token ids** (:func:`checked_input_ids`) are accepted as transformers returns them: a flat
sequence of integers (Python ints, numpy or torch integer scalars), a 1-D integer tensor or
array, one prompt as a batch of one (``[1, L]``, ``[[...]]``: ``return_tensors="pt"``, a
batched call), or a ``BatchEncoding`` (or any mapping) holding ``input_ids`` in one of those
forms (what ``apply_chat_template(..., tokenize=True)`` and ``tokenizer(text)`` return in
transformers 5). Each id must lie inside the model's vocabulary when the engine knows its size,
and the prompt must leave room to generate when the engine knows the model's context.
Everything else raises :class:`~rollstream.api.engine.InvalidRequestError` (the contract users
catch) saying what was found; in particular ``list(batch_encoding)``, which is the encoding's keys.

**Requests** (:func:`accepted_request`): rollstream's :class:`ModelRequest`, or any object with
its attributes: AReaL's ``areal.api.io_struct.ModelRequest`` with AReaL's
``GenerationHyperparameters`` is taken as it is, nothing imported from AReaL. Its settings become
rollstream's :class:`GenerationHyperparameters` field by field. Settings no engine here can
honour are refused rather than ignored: ``n_samples`` other than 1 (one call generates one
sequence, as AReaL's own engines require) and ``use_beam_search``. AReaL's ``lora_name`` and
``vision_msg_vllm`` are ignored: AReaL's SGLang path ignores them too unless LoRA is set up in
its engine, which no engine here does.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from rollstream.api.engine import InvalidRequestError
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse, StopReason
from rollstream.vision.images import ImageError, image_bytes

# What list(BatchEncoding) yields: its keys.
_ENCODING_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "position_ids", "mm_token_type_ids"})
_KEYS_HINT = (
    "list() of a BatchEncoding (what apply_chat_template(..., tokenize=True) and tokenizer(...) return "
    "in transformers 5) is its keys; pass the BatchEncoding itself, its ['input_ids'], or call "
    "apply_chat_template(..., return_dict=False)"
)
_SETTINGS = tuple(f.name for f in fields(GenerationHyperparameters))


def accepted_request(
    req: Any, *, vocab_size: int | None = None, max_context: int | None = None
) -> ModelRequest:
    """``req`` as the engine works on it: a new rollstream :class:`ModelRequest` whose
    ``input_ids`` are checked ints (:func:`checked_input_ids`) and whose ``gconfig`` is
    rollstream's (see the module doc); :class:`InvalidRequestError` otherwise."""
    if not hasattr(req, "input_ids"):
        raise InvalidRequestError(f"a request must be a ModelRequest; got {type(req).__name__}")
    ids = checked_input_ids(req.input_ids, vocab_size=vocab_size, max_context=max_context)
    image_data = getattr(req, "image_data", None)
    return ModelRequest(
        rid=str(getattr(req, "rid", "") or ModelRequest().rid),
        input_ids=ids,
        gconfig=accepted_settings(getattr(req, "gconfig", None)),
        metadata=dict(getattr(req, "metadata", None) or {}),
        image_data=list(image_data) if image_data else None,
        tokenizer=getattr(req, "tokenizer", None),
        processor=getattr(req, "processor", None),
    )


def response_to(
    req: ModelRequest, tokens: list[int], logprobs: list[float], versions: list[int], reason: StopReason,
    latency: float, ttft: float,
) -> ModelResponse:
    """The response to an accepted ``req``: it hands back the request's tokenizer, processor and images."""
    return ModelResponse(
        input_tokens=list(req.input_ids), output_tokens=tokens, output_logprobs=logprobs, output_versions=versions,
        stop_reason=reason, latency=latency, ttft=ttft, tokenizer=req.tokenizer,
        input_images=list(req.image_data or []), processor=req.processor,
    )


def request_image(image: Any, index: int) -> bytes:
    """``image_data[index]`` as the bytes of an image file; :class:`InvalidRequestError` when it is no image."""
    try:
        return image_bytes(image, f"image_data[{index}]")
    except ImageError as exc:
        raise InvalidRequestError(str(exc)) from None


def accepted_settings(gconfig: Any) -> GenerationHyperparameters:
    """Generation settings as rollstream's type (a copy for a foreign one; see the module doc)."""
    if gconfig is None:
        return GenerationHyperparameters()
    if getattr(gconfig, "use_beam_search", False):
        raise InvalidRequestError("gconfig.use_beam_search is set: no engine here runs beam search; sample instead")
    n = getattr(gconfig, "n_samples", 1)
    if n != 1:
        raise InvalidRequestError(
            f"gconfig.n_samples is {n}: one engine call generates one sequence; call agenerate once per "
            "sample (gconfig.new(n_samples=1)), as AReaL's engines require too"
        )
    if isinstance(gconfig, GenerationHyperparameters):
        return gconfig
    missing = [name for name in _SETTINGS if not hasattr(gconfig, name)]
    if missing:
        raise InvalidRequestError(f"gconfig is a {type(gconfig).__name__} without {missing}; expected GenerationHyperparameters")
    values = {name: getattr(gconfig, name) for name in _SETTINGS}
    # AReaL's new_with_stop_and_pad_token_ids adds the pad id even when a tokenizer has none
    values["stop_token_ids"] = [t for t in values["stop_token_ids"] or [] if t is not None]
    if values["stop"] is not None:
        values["stop"] = list(values["stop"])
    return GenerationHyperparameters(**values)


def checked_input_ids(
    input_ids: Any, *, vocab_size: int | None = None, max_context: int | None = None
) -> list[int]:
    """``input_ids`` as a list of ints, or :class:`InvalidRequestError` (see the module doc);
    ``max_context``: the most tokens the model can attend to."""
    ids = _as_int_list(_one_prompt(input_ids))
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


def _one_prompt(input_ids: Any) -> Any:
    """The one prompt's ids out of an encoding or a batch of one; refuses bigger batches."""
    if isinstance(input_ids, Mapping):
        if "input_ids" not in input_ids:
            raise InvalidRequestError(
                f"input_ids is a {type(input_ids).__name__} with keys {sorted(map(str, input_ids))[:5]} and no "
                "'input_ids'; expected token ids"
            )
        input_ids = input_ids["input_ids"]
    shape = getattr(input_ids, "shape", None)
    if shape is not None and not isinstance(input_ids, (str, bytes)):  # a tensor or array
        if len(shape) == 2 and shape[0] == 1:
            return input_ids[0]
        if len(shape) == 2:
            raise InvalidRequestError(
                f"input_ids has shape {list(shape)}: {shape[0]} prompts; send one prompt per request"
            )
        if len(shape) != 1:
            raise InvalidRequestError(f"input_ids has shape {list(shape)}; expected one prompt's token ids ([L] or [1, L])")
        return input_ids
    if isinstance(input_ids, (list, tuple)) and input_ids and _is_sequence(input_ids[0]):
        if len(input_ids) == 1:
            return input_ids[0]
        raise InvalidRequestError(
            f"input_ids is nested: {len(input_ids)} prompts (a batch?); send one prompt per request as a "
            "flat list of token ids"
        )
    return input_ids


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) > 0


def _as_int_list(input_ids: Any) -> list[int]:
    if isinstance(input_ids, (str, bytes)):
        raise InvalidRequestError(
            "input_ids is text, not token ids: tokenize it first (tokenizer.encode(text), or "
            "apply_chat_template(messages, tokenize=True))"
        )
    if not isinstance(input_ids, Sequence) and getattr(input_ids, "shape", None) is None:
        raise InvalidRequestError(f"input_ids is a {type(input_ids).__name__}; expected a list of token ids")
    values = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
    return [_as_token(value, i, values) for i, value in enumerate(values)]


def _as_token(value: Any, index: int, values: list[Any]) -> int:
    if isinstance(value, str):
        if set(values) <= _ENCODING_KEYS:
            raise InvalidRequestError(f"input_ids is {values!r}, not token ids: {_KEYS_HINT}")
        raise InvalidRequestError(f"input_ids[{index}] is the string {value[:40]!r}; expected token ids (integers): tokenize the text first")
    if _is_sequence(value):
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

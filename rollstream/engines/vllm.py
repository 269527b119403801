"""The vLLM server kind of :class:`~rollstream.engines.server_engine.ServerEngine`: vLLM's
token-in/token-out API (``POST /inference/v1/generate``, vLLM >= 0.32 with
``--enable-scale-out``; the rest of what the server needs is in ``vllm_admin.py``).

Callers may rely on (besides everything ``server_engine.py`` promises):

* The request is the prompt as token ids (``token_ids``: prompt + the tokens generated before a
  cut) and ``sampling_params`` mapped from ``GenerationHyperparameters`` onto vLLM's
  ``SamplingParams``: ``max_tokens``, ``temperature`` (0 when greedy), ``top_p``, ``top_k``
  (0 = off), ``min_tokens`` (what is left of ``min_new_tokens``), ``stop_token_ids``,
  ``ignore_eos``, ``frequency_penalty``, ``logprobs: 0`` (the sampled token's logprob), and
  ``stop`` strings only when set (they need the server to detokenize; without them it does
  not).
* The answer gives the sampled ids (``token_ids``), their logprobs and the finish reason (stop,
  length or abort: the server paused for a weight update). The logprob is what the server's
  ``--logprobs-mode`` computes: rollstream starts vLLM with ``processed_logprobs``,
  ``log_softmax`` of the logits after penalties and temperature, which is the one definition
  (:mod:`rollstream.engines.logprob_definition`) for every setting a training request may use
  (with ``top_k``/``top_p`` on, vLLM renormalises over the kept tokens: eval requests only).
* Tags: the answer's ``weight_versions`` spans (the label the engine core stamped on every decode
  pass that produced each token) tag each token, and name the fencing epoch of the sync owner that wrote
  each label; an answer with a token labelled ``loading:<v>@<epoch>`` (made during a weight
  load) is discarded and generated again; one without spans (an older vLLM) or with a label
  rollstream did not set is refused.
* Images are refused (``InvalidRequestError``): vLLM's token-in API takes preprocessed image
  features, which rollstream does not make.
"""

from __future__ import annotations

import math
from typing import Any

from rollstream.api.io_struct import GenerationHyperparameters
from rollstream.engines.server_engine import ServerEngine, Span, shared_sampling_params
from rollstream.engines.server_http import EngineRequestError, parse_label
from rollstream.engines.vllm_admin import VLLMAdmin

__all__ = ["VLLMEngine", "parse_tokens_answer", "vllm_sampling_params"]


def vllm_sampling_params(g: GenerationHyperparameters, remaining: int, generated: int) -> dict[str, Any]:
    """vLLM ``sampling_params`` for ``remaining`` more tokens after ``generated`` ones."""
    return {
        "max_tokens": remaining,
        "min_tokens": min(remaining, max(0, g.min_new_tokens - generated)),
        "logprobs": 0,
        "detokenize": bool(g.stop),
        **shared_sampling_params(g, top_k_off=0),
    }


def parse_tokens_answer(data: Any, where: str = "vLLM") -> Span:
    """The span of a token-in/token-out answer; EngineRequestError when unusable."""
    try:
        choice = data["choices"][0]
        tokens = [int(t) for t in choice["token_ids"] or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [_number(entry["logprob"]) for entry in content]
        finish = {"type": choice.get("finish_reason")}
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise EngineRequestError(f"unexpected /inference/v1/generate answer from {where}: {str(data)[:300]}") from exc
    if len(logprobs) != len(tokens):
        raise EngineRequestError(f"{where} answered {len(tokens)} tokens with {len(logprobs)} logprobs")
    spans = choice.get("weight_versions") or []
    labels = [parse_label(s.get("version")) for s in spans]
    epochs = [label.epoch for label in labels]
    if any(label.loading for label in labels):
        return Span(tokens, logprobs, finish, [], None, unlabelled=True, epochs=epochs)
    versions = token_versions(spans, len(tokens), where)
    return Span(tokens, logprobs, finish, versions, versions[-1] if versions else None, epochs=epochs)


def token_versions(spans: Any, count: int, where: str) -> list[int]:
    """One rollstream version per output token from vLLM's ``weight_versions`` spans."""
    if not count:
        return []
    if not spans:
        raise EngineRequestError(
            f"{where} answered without weight_versions: rollstream needs vLLM >= 0.32's token-in/token-out "
            "API, which labels every token with the weights that produced it")
    versions: list[int] = []
    for span in spans:
        version = parse_label(span.get("version")).version
        if version is None or span.get("start") != len(versions):
            raise EngineRequestError(
                f"{where} labels tokens {span!r}: not a rollstream version, or spans that do not tile the "
                "output (weights must be loaded through rollstream, which labels them <version>@<epoch>)")
        versions += [version] * (int(span["end"]) - int(span["start"]))
    if len(versions) != count:
        raise EngineRequestError(f"{where}'s weight_versions cover {len(versions)} of {count} tokens")
    return versions


# vLLM's token-in/token-out serving writes a NaN, -inf or missing logprob as max(logprob, -9999.0)
# (its OpenAI shapes' floor): a number, but none a sampled token can have.
VLLM_LOGPROB_FLOOR = -9999.0


def _number(value: Any) -> float | None:
    """A finite logprob, or None (NaN, infinity, vLLM's floor for them, or not a number)."""
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) and number > VLLM_LOGPROB_FLOOR else None


class VLLMEngine(ServerEngine):
    """HTTP client for one or more vLLM servers (see the module docstring)."""

    admin_class = VLLMAdmin
    generate_path = "/inference/v1/generate"
    request_id_key = "request_id"
    prompt_key = "token_ids"
    sampling_params = staticmethod(vllm_sampling_params)
    parse_answer = staticmethod(parse_tokens_answer)

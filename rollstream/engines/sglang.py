"""The SGLang server kind of :class:`~rollstream.engines.server_engine.ServerEngine`: SGLang's
native HTTP API (``/generate`` with ``input_ids``).

Callers may rely on (besides everything ``server_engine.py`` promises):

* ``/generate`` is sent ``input_ids``, ``rid``, ``return_logprob: true`` and
  ``sampling_params`` with SGLang's own keys only (SGLang >= 0.5.22 answers 400 to unknown
  ones); ``stop`` and ``min_new_tokens`` only when set (a server started with
  ``--skip-tokenizer-init`` refuses them; the error says so).
* Tags: each answer's ``meta_info.weight_version`` (the label ``"<version>@<epoch>"`` rollstream
  sets with every load) tags all of its tokens.
* **Images.** ``image_data`` is sent, with every submission of the request (resubmissions
  too), as a list of strings for the one request, the form SGLang's ``GenerateReqInput`` takes
  for a single ``input_ids`` prompt: base64 text, data URIs, paths or URLs go as they are (the
  server reads them); image bytes, PIL images and datasets' ``{"bytes", "path"}`` dicts are
  sent as base64. The prompt holds the placeholder tokens the model's processor made for the
  images, as AReaL sends it. Anything else raises ``InvalidRequestError``.
* A logprob SGLang wrote as JSON ``null`` (NaN or inf) fails the sample
  (``NonFiniteLogprobError``).
"""

from __future__ import annotations

from typing import Any

from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest
from rollstream.engines.request_check import request_image
from rollstream.engines.server_engine import NonFiniteLogprobError, ServerEngine, Span, shared_sampling_params
from rollstream.engines.server_http import EngineRequestError, EngineUnavailableError, HttpRefused, parse_label
from rollstream.engines.sglang_admin import SGLangAdmin
from rollstream.vision.images import to_base64

__all__ = [
    "EngineRequestError", "EngineUnavailableError", "NonFiniteLogprobError", "SGLangEngine",
    "parse_generate", "sampling_params",
]

def sampling_params(g: GenerationHyperparameters, remaining: int, generated: int) -> dict[str, Any]:
    """SGLang ``sampling_params`` for ``remaining`` more tokens after ``generated`` ones."""
    params = {"max_new_tokens": remaining, **shared_sampling_params(g, top_k_off=-1)}
    min_new = min(remaining, max(0, g.min_new_tokens - generated))
    if min_new:  # only when used: --skip-tokenizer-init servers refuse the key
        params["min_new_tokens"] = min_new
    return params


def parse_generate(data: Any, where: str = "SGLang") -> Span:
    """The span of a non-streaming ``/generate`` answer; EngineRequestError when unusable."""
    if isinstance(data, list) and data:
        data = data[0]
    try:
        meta = data["meta_info"]
        pairs = meta["output_token_logprobs"] or []
        tokens = [int(p[1]) for p in pairs]
        logprobs = [None if p[0] is None else float(p[0]) for p in pairs]
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise EngineRequestError(f"unexpected /generate answer from {where}: {str(data)[:300]}") from exc
    raw = meta.get("weight_version")
    label = parse_label(raw)
    version = label.version
    if version is None:
        raise EngineRequestError(
            f"{where} reports meta_info.weight_version={raw!r}, not a rollstream version: tokens are "
            "tagged with the version the server reports, so load weights through rollstream (which "
            "sends weight_version=<version>@<epoch>) and do not start SGLang with a non-integer --weight-version"
        )
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, str):
        finish = {"type": finish}
    return Span(tokens, logprobs, finish, [version] * len(tokens), version, epochs=[label.epoch])


class SGLangEngine(ServerEngine):
    """HTTP client for one or more SGLang servers (see the module docstring)."""

    admin_class = SGLangAdmin
    generate_path = "/generate"
    request_id_key = "rid"
    prompt_key = "input_ids"
    extra_body = {"return_logprob": True}
    sampling_params = staticmethod(sampling_params)
    parse_answer = staticmethod(parse_generate)

    def request_images(self, req: ModelRequest) -> list[str] | None:
        """``req.image_data`` as SGLang's ``/generate`` takes it (see the module docstring)."""
        images = req.image_data or []
        return [i if isinstance(i, str) else to_base64(request_image(i, n)) for n, i in enumerate(images)] or None

    def explain_refusal(self, exc: HttpRefused, body: dict[str, Any]) -> EngineRequestError:
        """The refusal, with a hint when it names settings a --skip-tokenizer-init server refuses."""
        params = body.get("sampling_params") or {}
        used = [k for k in ("stop", "min_new_tokens") if k in params]
        if exc.status == 400 and used:
            return EngineRequestError(
                f"{exc} (the request used {used}: a server started with --skip-tokenizer-init refuses "
                "them; start it without that flag or drop them from gconfig)")
        return exc


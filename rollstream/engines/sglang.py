"""An ``InferenceEngine`` that generates on (shared) SGLang servers over SGLang's native HTTP API.

Callers may rely on:

* **Tags come from the server.** Every output token carries the version of the weights that
  produced it, as the server reports it: ``meta_info.weight_version`` of the ``/generate``
  answer that returned the token (rollstream loads version ``v`` with ``weight_version="v"``;
  SGLang's initial ``"default"`` is version 0). A generation cut by a pause (finish_reason
  "abort") is resubmitted as prompt + partial output with the remaining budget; each returned
  span is tagged by its own answer, so one response can hold several versions, oldest first.
  An abort that exhausts the budget is reported as "length".
* **This engine never pauses or reloads a server while it generates.** Weight updates of a
  shared server are done by its one owner (``rollout_workers/weight_sync.py``). ``pause``,
  ``update_weights`` and ``resume`` act on every server and are meant for a process that owns
  all of them (``scripts/check_sglang.py``, tests).
* **Staleness.** ``set_version(v)`` declares the trainer's version. A call is sent only to a
  server that reports at least ``v - max_version_lag``; while none does, calls wait (at most
  ``catch_up_timeout_seconds``, re-reading the servers' versions every
  ``version_poll_seconds``), so a server that missed an update (down, slow) is not used until
  it caught up. A span that comes back older than required when it was sent (the server
  restarted meanwhile) is discarded and generated again.
* **Requests never collide.** Each HTTP attempt has its own rid (``<request rid>.<n>``), so a
  retry after a timeout, a resubmission after an abort or a failover is never refused as a
  duplicate of a request the server still holds; should a server answer 400 "Duplicate
  request ID" anyway, the call is retried with the next rid.
* ``/generate`` is sent ``input_ids``, ``rid``, ``return_logprob: true`` and
  ``sampling_params`` with SGLang's own keys only (SGLang >= 0.5.22 answers 400 to unknown
  ones); ``stop`` and ``min_new_tokens`` only when set (a server started with
  ``--skip-tokenizer-init`` refuses them; the error says so).
* **Images.** ``image_data`` is sent, with every submission of the request (resubmissions
  too), as a list of strings for the one request, the form SGLang's ``GenerateReqInput`` takes
  for a single ``input_ids`` prompt: base64 text, data URIs, paths or URLs go as they are (the
  server reads them); image bytes, PIL images and datasets' ``{"bytes", "path"}`` dicts are
  sent as base64. The prompt holds the placeholder tokens the model's processor made for the
  images, as AReaL sends it. Anything else raises ``InvalidRequestError``.
* **Faults.** Connection errors, timeouts and HTTP 5xx are retried up to ``max_retries`` times
  with capped exponential backoff and jitter; ``failure_threshold`` failures in a row mark a
  server down for ``down_cooldown_seconds`` and its calls move to the others. With no server
  up (or retries exhausted) ``agenerate`` raises ``EngineUnavailableError``; other HTTP 4xx
  raise ``EngineRequestError`` at once. A logprob SGLang wrote as JSON ``null`` (NaN or inf)
  raises ``NonFiniteLogprobError`` naming the position, so the sample fails with that reason.
* Routing (``sglang_pool.py``): a new request goes to the current server with the fewest calls
  in flight; its resubmissions stay on that server (bounded LRU) while it is current and up.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollstream.api.engine import InferenceEngine, WeightUpdate
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse, StopReason
from rollstream.api.request_check import InvalidRequestError, accepted_request
from rollstream.config import SGLangConfig
from rollstream.engines.sglang_admin import ServerHealth, SGLangAdmin
from rollstream.engines.sglang_http import (
    TRANSPORT_ERRORS,
    EngineRequestError,
    EngineUnavailableError,
    HttpRefused,
    Retryable,
    SGLangHttp,
    parse_weight_version,
)
from rollstream.engines.sglang_pool import Server, ServerPool, SGLangEngineStats
from rollstream.retry import RetriesExhausted, RetryPolicy
from rollstream.vision.images import ImageError, image_bytes, to_base64

__all__ = [
    "EngineRequestError", "EngineUnavailableError", "NonFiniteLogprobError", "SGLangEngine",
    "SGLangEngineStats", "Span", "parse_generate", "sampling_params",
]

logger = logging.getLogger(__name__)

_TOP_K_OFF = int(1e8)  # GenerationHyperparameters' "no top-k" default


class NonFiniteLogprobError(EngineRequestError):
    """SGLang wrote a NaN or infinite logprob (JSON ``null``): the sample cannot be trained on."""


@dataclass
class Span:
    """One ``/generate`` answer: its tokens, their logprobs (None = SGLang's null), how it
    ended, and the version of the weights that produced it."""

    tokens: list[int]
    logprobs: list[float | None]
    finish: dict[str, Any]
    version: int


def sampling_params(g: GenerationHyperparameters, remaining: int, generated: int) -> dict[str, Any]:
    """SGLang ``sampling_params`` for ``remaining`` more tokens after ``generated`` ones."""
    top_k = -1 if g.top_k <= 0 or g.top_k >= _TOP_K_OFF else int(g.top_k)
    params: dict[str, Any] = {
        "max_new_tokens": remaining,
        "temperature": 0.0 if g.greedy else float(g.temperature),
        "top_p": float(g.top_p),
        "top_k": top_k,
        "stop_token_ids": list(g.stop_token_ids),
        "ignore_eos": bool(g.ignore_eos),
        "skip_special_tokens": bool(g.skip_special_tokens),
        "frequency_penalty": float(g.frequency_penalty),
    }
    min_new = min(remaining, max(0, g.min_new_tokens - generated))
    if min_new:  # only when used: --skip-tokenizer-init servers refuse the key
        params["min_new_tokens"] = min_new
    if g.stop:
        params["stop"] = list(g.stop)
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
    version = parse_weight_version(raw)
    if version is None:
        raise EngineRequestError(
            f"{where} reports meta_info.weight_version={raw!r}, not a rollstream version: tokens are "
            "tagged with the version the server reports, so load weights through rollstream (which "
            "sends weight_version=<version>) and do not start SGLang with a non-integer --weight-version"
        )
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, str):
        finish = {"type": finish}
    return Span(tokens, logprobs, finish, version)


class SGLangEngine(InferenceEngine):
    """HTTP client for one or more SGLang servers (see the module docstring)."""

    def __init__(
        self, base_urls: list[str], tokenizer_path: str | None = None, settings: SGLangConfig | None = None,
    ) -> None:
        if not base_urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        self.tokenizer_path = tokenizer_path
        self.settings = settings or SGLangConfig()
        self.http = SGLangHttp(self.settings)
        self.admin = SGLangAdmin(self.http)
        self.stats = SGLangEngineStats()
        self.pool = ServerPool(base_urls, self.settings, self.admin, self.stats)
        self.servers = self.pool.servers
        self._tokenizer: Any = None

    # ----------------------------------------------------------------- lifecycle

    @property
    def tokenizer(self) -> Any:
        """``AutoTokenizer`` from ``tokenizer_path``, or None when no path was given."""
        if self._tokenizer is None and self.tokenizer_path:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        return self._tokenizer

    async def start(self) -> None:
        """Wait (``health_timeout_seconds``) until every server is up and read its version.

        "Up" includes a server that does not generate right now (paused for a weight update by
        its owner): it answers ``/model_info``. Servers still down at the deadline are marked
        down and logged; ``EngineUnavailableError`` names them when none is up.
        """
        deadline = time.monotonic() + self.settings.health_timeout_seconds
        results = await asyncio.gather(*(self._wait_up(s, deadline) for s in self.servers))
        down = [s.url for s, up in zip(self.servers, results) if not up]
        if len(down) == len(self.servers):
            raise EngineUnavailableError(
                f"SGLang servers not up after {self.settings.health_timeout_seconds}s: {down}")
        for url in down:
            logger.error("SGLang %s is down at start: not used until it answers again", url)
            self.pool.mark_down(self.pool.server(url))

    async def _wait_up(self, server: Server, deadline: float) -> bool:
        while True:
            probe = await self.admin.probe(server.url)
            if probe.health is not ServerHealth.DOWN:
                server.version = probe.weight_version
                if probe.health is ServerHealth.NOT_GENERATING:
                    logger.info("SGLang %s is up but not generating (%s): paused for a weight update?",
                                server.url, probe.detail)
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(0.5, left))

    async def close(self) -> None:
        await self.http.close()

    # ------------------------------------------------------------------- versions

    def get_version(self) -> int:
        """The trainer's version as last declared: new tokens carry at least this minus
        ``max_version_lag``."""
        return self.pool.trainer_version

    def set_version(self, version: int) -> None:
        """Declare the trainer's version; servers behind it are not used until they catch up."""
        self.pool.trainer_version = version

    def server_versions(self) -> dict[str, int | None]:
        """The version each server last reported (for tests, status and logs)."""
        return {s.url: s.version for s in self.servers}

    # ------------------------------------------- whole-fleet control (single owner only)

    async def pause(self) -> None:
        """Pause every server that is up; returns once each answered (bounded)."""
        await self._each(self.admin.pause, "/pause_generation")

    async def update_weights(self, update: WeightUpdate) -> None:
        """Load ``update`` on every server; EngineUnavailableError when none succeeded."""
        servers = self.pool.up_servers()
        results = await asyncio.gather(*(self.admin.load(s.url, update) for s in servers), return_exceptions=True)
        for server, result in zip(servers, results):
            if isinstance(result, BaseException):
                logger.error("weight update to version %d failed on %s: %r", update.version, server.url, result)
            else:
                server.version = update.version
        if all(isinstance(r, BaseException) for r in results):
            raise EngineUnavailableError(f"weight update to version {update.version} failed on every server")

    async def resume(self) -> None:
        """``/continue_generation`` on every server that is up."""
        await self._each(self.admin.resume, "/continue_generation")

    async def _each(self, op: Any, what: str) -> None:
        servers = self.pool.up_servers()
        results = await asyncio.gather(*(op(s.url) for s in servers), return_exceptions=True)
        for server, result in zip(servers, results):
            if isinstance(result, BaseException):
                logger.warning("%s on %s failed: %r", what, server.url, result)

    # ----------------------------------------------------------------- generation

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for ``req``, resuming across pauses (see the module docstring). AReaL's own
        request and settings types are accepted (``rollstream.api.request_check``)."""
        req = accepted_request(req)  # a malformed request fails here, alone, with its cause
        images = sglang_image_data(req.image_data) if req.image_data else None
        g = req.gconfig
        budget = g.budget(len(req.input_ids))
        started = time.monotonic()
        ttft = float("inf")
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reason: StopReason = "length"  # also for an abort that used up the budget
        empty_aborts = 0
        attempts = itertools.count()  # a fresh rid per HTTP attempt
        while len(tokens) < budget:
            payload = self._payload(req, tokens, budget, images)
            server, span, minimum = await self._generate(req.rid, payload, attempts)
            if span.version < minimum:  # the server went back (restarted) after it was picked
                self.stats.stale_spans += 1
                logger.warning("%s answered with weights v%d, older than v%d: span discarded",
                               server.url, span.version, minimum)
                continue
            chunk = span.tokens[: budget - len(tokens)]  # never trust a server past the budget
            logprobs += _finite(span.logprobs[: len(chunk)], len(tokens), req.rid, server.url)
            tokens += chunk
            versions += [span.version] * len(chunk)
            if chunk and ttft == float("inf"):
                ttft = time.monotonic() - started
            kind = span.finish.get("type")
            if kind in ("stop", "length"):
                reason = kind
                break
            if kind != "abort":
                raise EngineRequestError(f"unknown finish_reason {span.finish!r} for rid {req.rid}")
            empty_aborts = 0 if chunk else empty_aborts + 1
            await self._after_abort(req.rid, span.finish, empty_aborts)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=versions,
            stop_reason=reason,
            latency=time.monotonic() - started,
            ttft=ttft,
            tokenizer=req.tokenizer,
            input_images=list(req.image_data or []),
            processor=req.processor,
        )

    async def _after_abort(self, rid: str, finish: dict[str, Any], empty_aborts: int) -> None:
        """An abort with a client error raises; a pause (by the server's owner) is resumed."""
        self.stats.resubmissions += 1
        status = finish.get("status_code")
        if isinstance(status, int) and 400 <= status < 500:
            raise EngineRequestError(f"rid {rid} aborted by the server: {finish!r}")
        if empty_aborts > self.settings.max_retries:
            raise EngineRequestError(f"rid {rid} aborted {empty_aborts} times without progress: {finish!r}")
        if empty_aborts:
            await asyncio.sleep(self._retry_policy().pause(empty_aborts))  # shedding load: do not spin

    def _payload(self, req: ModelRequest, generated: list[int], budget: int, images: list[str] | None) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "input_ids": list(req.input_ids) + generated,
            "sampling_params": sampling_params(req.gconfig, budget - len(generated), len(generated)),
            "return_logprob": True,
        }
        if images:
            payload["image_data"] = images
        return payload

    async def _generate(
        self, rid: str, payload: dict[str, Any], attempts: itertools.count[int],
    ) -> tuple[Server, Span, int]:
        """POST /generate with retries and failover: the server, its span, the minimum version.
        ``rollout.sglang.max_retries`` retries, paused by :meth:`_retry_policy`."""
        backoff = self._retry_policy().limited(max_attempts=self.settings.max_retries + 1).backoff()
        last_error: BaseException | None = None
        while True:
            server, minimum = await self.pool.pick(rid, last_error)
            body = {**payload, "rid": f"{rid}.{next(attempts)}"}
            try:
                span = parse_generate(await self._tracked_post(server, body), server.url)
                server.version = span.version  # the server's own word is the freshest
                return server, span, minimum
            except HttpRefused as exc:
                if not exc.duplicate_rid:
                    raise _explain(exc, payload) from None
                self.stats.duplicate_rids += 1  # the next attempt has a new rid
                last_error = exc
            except (*TRANSPORT_ERRORS, Retryable) as exc:
                last_error = exc
                self.pool.record_failure(server, exc)
            try:
                await backoff.sleep(last_error)
            except RetriesExhausted:
                raise EngineUnavailableError(
                    f"/generate for rid {rid} failed after {backoff.failures} attempts: {last_error!r}"
                ) from None

    async def _tracked_post(self, server: Server, body: dict[str, Any]) -> Any:
        server.inflight += 1
        self.stats.http_attempts += 1
        self.stats.calls_per_server[server.url] += 1
        try:
            data = await self.http.post(server.url, "/generate", body, self.settings.request_timeout_seconds)
        finally:
            server.inflight -= 1
        self.pool.record_success(server)
        return data

    def _retry_policy(self) -> RetryPolicy:
        """The shared policy's shape with the pauses of ``rollout.sglang`` (backoff settings)."""
        return RetryPolicy(initial=self.settings.backoff_base_seconds, maximum=self.settings.backoff_max_seconds,
                           jitter=self.settings.backoff_base_seconds)

    def server_for(self, rid: str) -> str | None:
        """The URL a request's ``rid`` is pinned to, if any (for tests and debugging)."""
        return self.pool.server_for(rid)


def _finite(logprobs: list[float | None], offset: int, rid: str, url: str) -> list[float]:
    """``logprobs`` unchanged, or NonFiniteLogprobError at the first null (SGLang's NaN/inf)."""
    for i, lp in enumerate(logprobs):
        if lp is None:
            raise NonFiniteLogprobError(
                f"{url} returned a null (NaN or infinite) logprob for output token {offset + i} of "
                f"rid {rid}: the sample is dropped rather than trained on")
    return logprobs  # type: ignore[return-value]  # no None left


def _explain(exc: HttpRefused, payload: dict[str, Any]) -> EngineRequestError:
    """The refusal, with a hint when it names settings a --skip-tokenizer-init server refuses."""
    params = payload.get("sampling_params") or {}
    used = [k for k in ("stop", "min_new_tokens") if k in params]
    if exc.status == 400 and used:
        return EngineRequestError(
            f"{exc} (the request used {used}: a server started with --skip-tokenizer-init refuses "
            "them; start it without that flag or drop them from gconfig)")
    return exc


def sglang_image_data(images: Sequence[Any]) -> list[str]:
    """``ModelRequest.image_data`` as SGLang's ``/generate`` takes it (see the module docstring)."""
    out: list[str] = []
    for index, image in enumerate(images):
        if isinstance(image, str):
            out.append(image)
            continue
        try:
            out.append(to_base64(image_bytes(image, f"image_data[{index}]")))
        except ImageError as exc:
            raise InvalidRequestError(str(exc)) from None
    return out

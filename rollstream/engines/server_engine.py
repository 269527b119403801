"""An ``InferenceEngine`` that generates on (shared) inference servers over HTTP.

The server kinds (``sglang.py``, ``vllm.py``) say how a request is written and an answer read;
everything else is here, once for both.

Callers may rely on:

* **Tags come from the server.** Every output token carries the version of the weights that
  produced it, as the server labels it in its answer (rollstream loads version ``v`` with the
  label ``"v@<epoch>"``, the fencing epoch of the sync owner that loaded it; the launch weights'
  label ``"default"`` is version 0). A generation cut by a pause (an answer that ends in
  "abort") is resubmitted as prompt + partial output with the remaining budget; a generation
  frozen by a ``keep`` pause goes on and its answer labels each decode pass; either way one response
  can hold several versions, oldest first. An abort that exhausts the budget is reported as
  "length". A request a weight update cut before its first token is sent again and never
  counts toward ``max_retries`` (``stats.update_cuts``).
* **This engine never pauses or reloads a server while it generates.** Weight updates of a
  shared server are done by its one sync owner (``rollout_workers/weight_sync.py``). ``pause``,
  ``update_weights`` and ``resume`` act on every server and are meant for a process that owns
  all of them (``scripts/check_sglang.py``, tests).
* **Staleness.** ``set_version(v)`` declares the trainer's version. A call is sent only to a
  server that reports at least ``v - max_version_lag``; while none does, calls wait (at most
  ``catch_up_timeout_seconds``, re-reading the servers' versions every
  ``version_poll_seconds``), so a server that missed an update (down, slow) is not used until
  it caught up. A span that comes back older than required when it was sent (the server
  restarted meanwhile) is discarded and generated again, and so is one whose tokens the server
  labels as made during a weight load, or labelled by a former sync owner after its successor (an
  older fencing epoch than the server had accepted before the request was sent:
  ``server_pool.stale_labels``): no token is ever tagged with weights that did not produce it.
* **Requests never collide.** Each HTTP attempt has its own request id (``<request rid>.<n>``),
  so a retry after a timeout, a resubmission after an abort or a failover is never refused as a
  duplicate of a request the server still holds; should a server answer 400 "Duplicate
  request ID" anyway, the call is retried with the next id.
* **Faults.** Connection errors, timeouts and HTTP 5xx are retried up to ``max_retries`` times
  with capped exponential backoff and jitter; ``failure_threshold`` failures in a row mark a
  server down for ``down_cooldown_seconds`` and its calls move to the others. With no server
  up (or retries exhausted) ``agenerate`` raises ``EngineUnavailableError``; other HTTP 4xx
  raise ``EngineRequestError`` at once. A logprob the server could not write as a number (NaN
  or inf: SGLang's ``null``, vLLM's ``-9999.0``) raises ``NonFiniteLogprobError`` naming the
  position, so the sample fails with that reason.
* Routing (``server_pool.py``): a new request goes to the current server with the fewest calls
  in flight; its resubmissions stay on that server (bounded LRU) while it is current and up.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from rollstream.api.engine import InferenceEngine, WeightUpdate
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse, StopReason, top_k_is_on
from rollstream.api.engine import InvalidRequestError
from rollstream.engines.request_check import accepted_request, response_to
from rollstream.config import ServerConfig
from rollstream.engines.server_admin import PauseMode, ServerAdmin, ServerHealth, time_epoch
from rollstream.engines.server_http import (
    TRANSPORT_ERRORS,
    EngineRequestError,
    EngineUnavailableError,
    HttpRefused,
    Retryable,
    ServerHttp,
)
from rollstream.engines.server_pool import Server, ServerEngineStats, ServerPool, stale_labels
from rollstream.retry import RetriesExhausted, RetryPolicy

__all__ = ["NonFiniteLogprobError", "ServerEngine", "Span"]

logger = logging.getLogger(__name__)


def shared_sampling_params(g: GenerationHyperparameters, top_k_off: int) -> dict[str, Any]:
    """The ``sampling_params`` SGLang and vLLM name alike (``top_k_off``: the server's "no top-k");
    ``stop`` only when set."""
    params: dict[str, Any] = {
        "temperature": 0.0 if g.greedy else float(g.temperature),
        "top_p": float(g.top_p),
        "top_k": int(g.top_k) if top_k_is_on(g.top_k) else top_k_off,
        "stop_token_ids": list(g.stop_token_ids),
        "ignore_eos": bool(g.ignore_eos),
        "skip_special_tokens": bool(g.skip_special_tokens),
        "frequency_penalty": float(g.frequency_penalty),
    }
    if g.stop:
        params["stop"] = list(g.stop)
    return params


class NonFiniteLogprobError(EngineRequestError):
    """The server wrote a NaN or infinite logprob: the sample cannot be trained on."""


@dataclass
class Span:
    """One generate answer: its tokens, their logprobs (None: not a finite number), how it
    ended (``finish["type"]``: stop, length or abort), the version of each token, and the
    version the server reported at the end of the answer (None when it reported none, e.g. a
    vLLM answer without tokens)."""

    tokens: list[int]
    logprobs: list[float | None]
    finish: dict[str, Any]
    versions: list[int]
    reported: int | None
    # Some tokens were labelled as produced during a weight load (a label that is no version):
    # which weights produced them is unknown, so the whole answer is generated again.
    unlabelled: bool = False
    epochs: list[int] = field(default_factory=list)  # fencing epochs of the labels, in token order (0: none)
    stale_epoch: bool = False  # some label was written by a former owner: generated again

    def older_than(self, minimum: int) -> bool:
        """Produced (or reported) by weights older than ``minimum``."""
        return any(v < minimum for v in self.versions) or (self.reported is not None and self.reported < minimum)


class ServerEngine(InferenceEngine):
    """HTTP client for one or more servers of one kind (see the module docstring)."""

    admin_class: ClassVar[type[ServerAdmin]]
    generate_path: ClassVar[str]
    request_id_key: ClassVar[str]  # the body key that names the request id
    prompt_key: ClassVar[str]  # the body key of the prompt's token ids
    extra_body: ClassVar[dict[str, Any]] = {}  # sent with every generate request
    # The server's sampling_params for ``remaining`` more tokens after ``generated`` ones.
    sampling_params: ClassVar[Callable[[GenerationHyperparameters, int, int], dict[str, Any]]]
    # The span of a generate answer (the server's URL names it in errors); EngineRequestError when unusable.
    parse_answer: ClassVar[Callable[[Any, str], Span]]

    def __init__(
        self, base_urls: list[str], tokenizer_path: str | None = None, settings: ServerConfig | None = None,
        weight_update_mode: PauseMode = "abort",
    ) -> None:
        if not base_urls:
            raise ValueError(f"{type(self).__name__} needs at least one server URL")
        self.tokenizer_path = tokenizer_path
        self.weight_update_mode = weight_update_mode
        self.settings = settings or ServerConfig()
        self.http = ServerHttp(self.settings)
        self.admin = self.admin_class(self.http)
        self.stats = ServerEngineStats()
        self.pool = ServerPool(base_urls, self.settings, self.admin, self.stats)
        self.servers = self.pool.servers
        self._tokenizer: Any = None

    # ------------------------------------------------------------ the server kind

    def request_body(self, req: ModelRequest, generated: list[int], budget: int, images: Any) -> dict[str, Any]:
        """The generate request for ``req`` after ``generated`` tokens (no request id yet)."""
        params = self.sampling_params(req.gconfig, budget - len(generated), len(generated))
        body = {self.prompt_key: list(req.input_ids) + generated, "sampling_params": params, **self.extra_body}
        if images:
            body["image_data"] = images
        return body

    def request_images(self, req: ModelRequest) -> Any:
        """``req.image_data`` in the server's form, converted once per request (default:
        refused when there are any)."""
        if req.image_data:
            raise InvalidRequestError(
                f"the {self.admin.kind} engine does not take image_data yet: run vision workflows on the "
                "sglang or hf engine")
        return None

    def explain_refusal(self, exc: HttpRefused, body: dict[str, Any]) -> EngineRequestError:
        """The error a refused request raises (a server kind may add a hint)."""
        return exc

    # ----------------------------------------------------------------- lifecycle

    @property
    def tokenizer(self) -> Any:
        """``AutoTokenizer`` from ``tokenizer_path``, or None when no path was given."""
        if self._tokenizer is None and self.tokenizer_path:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        return self._tokenizer

    async def start(self) -> None:
        """Wait (``health_timeout_seconds``) until every server is up, check it serves the API
        this engine needs, and read its version.

        "Up" includes a server that does not generate right now (paused for a weight update by
        its sync owner). Servers still down at the deadline are marked down and logged;
        ``EngineUnavailableError`` names them when none is up. A server without the API raises
        ``EngineRequestError`` saying how to start it.
        """
        deadline = time.monotonic() + self.settings.health_timeout_seconds
        results = await asyncio.gather(*(self._wait_up(s, deadline) for s in self.servers))
        down = [s.url for s, up in zip(self.servers, results) if not up]
        kind = self.admin.kind
        if len(down) == len(self.servers):
            raise EngineUnavailableError(f"{kind} servers not up after {self.settings.health_timeout_seconds}s: {down}")
        for server, up in zip(self.servers, results):
            if not up:
                logger.error("%s %s is down at start: not used until it answers again", kind, server.url)
                self.pool.mark_down(server)
        await asyncio.gather(*(self.admin.check_api(s.url, self.weight_update_mode)
                               for s in self.servers if s.url not in down))

    async def _wait_up(self, server: Server, deadline: float) -> bool:
        while True:
            probe = await self.admin.probe(server.url)
            if probe.health is not ServerHealth.DOWN:
                server.observe(probe.label)
                if probe.health is ServerHealth.NOT_GENERATING:
                    logger.info("%s %s is up but not generating (%s): paused for a weight update?",
                                self.admin.kind, server.url, probe.detail)
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

    # ------------------------------------------- whole-fleet control (a process that owns every server)

    # A process that owns every server fences its calls with the clock (``time_epoch``), taken
    # once per pause, so its load and resume come with the pause's epoch.
    _fleet_epoch = 0

    async def pause(self) -> None:
        """Pause every server that is up; returns once each answered (bounded)."""
        self._fleet_epoch = time_epoch()
        await self._each(lambda url: self.admin.pause(url, self._fleet_epoch, self.weight_update_mode), "pause")

    async def update_weights(self, update: WeightUpdate) -> None:
        """Load ``update`` on every server; EngineUnavailableError when none succeeded."""
        servers = self.pool.up_servers()
        epoch = self._fleet_epoch = max(self._fleet_epoch, time_epoch())
        results = await asyncio.gather(*(self.admin.load(s.url, update, epoch, self.weight_update_mode)
                                         for s in servers), return_exceptions=True)
        for server, result in zip(servers, results):
            if isinstance(result, BaseException):
                logger.error("weight update to version %d failed on %s: %r", update.version, server.url, result)
            else:
                server.version, server.epoch = update.version, epoch
        if all(isinstance(r, BaseException) for r in results):
            raise EngineUnavailableError(f"weight update to version {update.version} failed on every server")

    async def resume(self) -> None:
        """Continue every server that is up."""
        epoch = self._fleet_epoch = max(self._fleet_epoch, time_epoch())
        await self._each(lambda url: self.admin.resume(url, epoch), "resume")

    async def _each(self, op: Any, what: str) -> None:
        servers = self.pool.up_servers()
        results = await asyncio.gather(*(op(s.url) for s in servers), return_exceptions=True)
        for server, result in zip(servers, results):
            if isinstance(result, BaseException):
                logger.warning("%s of %s failed: %r", what, server.url, result)

    # ----------------------------------------------------------------- generation

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for ``req``, resuming across pauses (see the module docstring). AReaL's own
        request and settings types are accepted (``rollstream.engines.request_check``)."""
        req = accepted_request(req)  # a malformed request fails here, alone, with its cause
        images = self.request_images(req)
        budget = req.gconfig.budget(len(req.input_ids))
        started = time.monotonic()
        ttft = float("inf")
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reason: StopReason = "length"  # also for an abort that used up the budget
        empty_aborts = 0
        attempts = itertools.count()  # a fresh request id per HTTP attempt
        while len(tokens) < budget:
            body = self.request_body(req, tokens, budget, images)
            server, span, minimum, sent = await self._generate(req.rid, body, attempts)
            if span.unlabelled:  # made while a (stale) sync owner loaded weights: which ones, nobody knows
                self.stats.unlabelled_spans += 1
                server.version = None  # read again before the next call: wait for the load to end
                logger.warning("%s labelled tokens as made during a weight load: answer discarded", server.url)
                continue
            if span.stale_epoch:  # a former sync owner's label: the server's sync owner reloads it
                self.stats.stale_epoch_spans += 1
                logger.warning("%s labelled tokens with a former sync owner's epoch %s (newest seen %d): "
                               "answer discarded",
                               server.url, span.epochs, server.epoch)
                continue
            if span.older_than(minimum):  # the server went back (restarted) after it was picked
                self.stats.stale_spans += 1
                logger.warning("%s answered with weights older than v%d (%s): span discarded",
                               server.url, minimum, sorted(set(span.versions)) or span.reported)
                continue
            chunk = span.tokens[: budget - len(tokens)]  # never trust a server past the budget
            logprobs += _finite(span.logprobs[: len(chunk)], len(tokens), req.rid, server.url)
            tokens += chunk
            versions += span.versions[: len(chunk)]
            if chunk and ttft == float("inf"):
                ttft = time.monotonic() - started
            kind = span.finish.get("type")
            if kind in ("stop", "length"):
                reason = kind
                break
            if kind != "abort":
                raise EngineRequestError(f"unknown finish reason {span.finish!r} for rid {req.rid}")
            empty_aborts = await self._after_abort(req.rid, span.finish, empty_aborts, bool(chunk), server, sent)
        return response_to(req, tokens, logprobs, versions, reason, time.monotonic() - started, ttft)

    async def _after_abort(self, rid: str, finish: dict[str, Any], empty_aborts: int, progress: bool,
                           server: Server, sent: tuple[int | None, int]) -> int:
        """After an abort: the count of aborts in a row without progress. An abort with a client
        error raises; a pause (by the server's sync owner) is resumed, and one that cut the request
        before its first token is no failure; other aborts without progress count toward
        ``max_retries``, with a pause between them."""
        self.stats.resubmissions += 1
        status = finish.get("status_code")
        if isinstance(status, int) and 400 <= status < 500:
            raise EngineRequestError(f"rid {rid} aborted by the server: {finish!r}")
        if progress:
            return 0
        try:
            cut_by_update = await self.admin.updating(server.url, sent)
        except (*TRANSPORT_ERRORS, EngineRequestError):
            cut_by_update = False
        if cut_by_update:
            self.stats.update_cuts += 1
            server.version = None  # read again before the next call: wait for the update to end
            return empty_aborts
        empty_aborts += 1
        if empty_aborts > self.settings.max_retries:
            raise EngineRequestError(f"rid {rid} aborted {empty_aborts} times without progress: {finish!r}")
        await asyncio.sleep(self._retry_policy().pause(empty_aborts))  # shedding load: do not spin
        return empty_aborts

    async def _generate(
        self, rid: str, body: dict[str, Any], attempts: itertools.count[int],
    ) -> tuple[Server, Span, int, tuple[int | None, int]]:
        """POST the request with retries and failover: the server, its span, the minimum version
        and the server's label (version, epoch) when it was picked.
        ``rollout.server.max_retries`` retries, paused by :meth:`_retry_policy`."""
        backoff = self._retry_policy().limited(max_attempts=self.settings.max_retries + 1).backoff()
        last_error: BaseException | None = None
        while True:
            server, minimum = await self.pool.pick(rid, last_error)
            sent = (server.version, server.epoch)
            attempt = {**body, self.request_id_key: f"{rid}.{next(attempts)}"}
            server.inflight += 1
            self.stats.http_attempts += 1
            self.stats.calls_per_server[server.url] += 1
            try:
                data = await self.http.post(server.url, self.generate_path, attempt, self.settings.request_timeout_seconds)
                server.failures = 0  # a success ends a run of failures
                span = self.parse_answer(data, server.url)
                span.stale_epoch = stale_labels(span.epochs, sent[1])
                server.epoch = max(server.epoch, *span.epochs, 0)
                if span.stale_epoch:
                    server.version = None  # a former sync owner's label: not current until relabelled
                elif span.reported is not None:
                    server.version = span.reported  # the server's own word is the freshest
                return server, span, minimum, sent
            except HttpRefused as exc:
                if not exc.duplicate_rid:
                    raise self.explain_refusal(exc, body) from None
                self.stats.duplicate_rids += 1  # the next attempt has a new id
                last_error = exc
            except (*TRANSPORT_ERRORS, Retryable) as exc:
                last_error = exc
                self.pool.record_failure(server, exc)
            finally:
                server.inflight -= 1
            try:
                await backoff.sleep(last_error)
            except RetriesExhausted:
                raise EngineUnavailableError(
                    f"generate for rid {rid} failed after {backoff.failures} attempts: {last_error!r}"
                ) from None

    def _retry_policy(self) -> RetryPolicy:
        """The shared policy's shape with the pauses of ``rollout.server`` (backoff settings)."""
        return RetryPolicy(initial=self.settings.backoff_base_seconds, maximum=self.settings.backoff_max_seconds,
                           jitter=self.settings.backoff_base_seconds)

    def server_for(self, rid: str) -> str | None:
        """The URL a request's ``rid`` is pinned to, if any (for tests and debugging)."""
        return self.pool.server_for(rid)


def _finite(logprobs: list[float | None], offset: int, rid: str, url: str) -> list[float]:
    """``logprobs`` unchanged, or NonFiniteLogprobError at the first None (NaN or inf)."""
    for i, lp in enumerate(logprobs):
        if lp is None:
            raise NonFiniteLogprobError(
                f"{url} returned a null (NaN or infinite; SGLang writes null, vLLM -9999.0) logprob for output "
                f"token {offset + i} of rid {rid}: the sample is dropped rather than trained on")
    return logprobs  # type: ignore[return-value]  # no None left

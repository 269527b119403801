"""An ``InferenceEngine`` that talks to SGLang servers over SGLang's native HTTP API.

Callers may rely on:

* ``/generate`` is sent ``input_ids``, ``rid``, ``return_logprob: true`` and ``sampling_params``
  holding only SGLang's own keys (never OpenAI names such as ``max_tokens``, which SGLang >= 0.5.23
  rejects). Tokens and logprobs come from ``meta_info.output_token_logprobs``.
* A request cut off by ``pause`` (finish_reason "abort") is resubmitted as prompt + partial
  output with the remaining budget and the same ``rid`` once the engine is resumed. Each returned
  chunk's tokens carry the engine version current when the chunk came back; ``pause`` waits
  (bounded) for the aborted chunks to come back, so chunks cut by a pause carry the old version.
  An abort that exhausts the budget is reported as "length".
* Routing: a new ``rid`` goes to the usable server with the fewest requests in flight; a known
  ``rid`` stays on its server (bounded LRU) while that server is usable.
* Connection errors, timeouts and HTTP 5xx are retried up to ``max_retries`` times with capped
  exponential backoff and jitter. ``failure_threshold`` consecutive failures mark a server down
  for ``down_cooldown`` seconds and its requests move to the others. With no usable server left
  (or retries exhausted) ``agenerate`` raises ``EngineUnavailableError``; HTTP 4xx raises
  ``EngineRequestError`` at once.
* A server whose weight update (or ``/continue_generation``) failed is not used again until a
  later update (or resume) succeeds on it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import aiohttp

from rollstream.api.engine import InferenceEngine, WeightUpdate
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse, StopReason
from rollstream.api.request_check import checked_input_ids

logger = logging.getLogger(__name__)

_TOP_K_OFF = int(1e8)  # GenerationHyperparameters' "no top-k" default


class EngineUnavailableError(RuntimeError):
    """No SGLang server could serve the call: all are down, unhealthy, or retries ran out."""


class EngineRequestError(RuntimeError):
    """A server rejected the request (HTTP 4xx or an error abort) or answered unparseably."""


class _Retryable(Exception):
    """An HTTP 5xx answer: worth another try, maybe on another server."""


@dataclass(eq=False)
class _Server:
    url: str
    inflight: int = 0
    failures: int = 0  # consecutive
    down_until: float = 0.0
    weights_ok: bool = True  # False after a failed weight update
    running_ok: bool = True  # False after a failed /continue_generation: it may still be paused

    def usable(self, now: float) -> bool:
        return self.weights_ok and self.running_ok and self.down_until <= now


@dataclass
class SGLangEngineStats:
    """Counters for monitoring and tests (never reset by the engine)."""

    http_attempts: int = 0
    http_failures: int = 0
    resubmissions: int = 0
    servers_marked_down: int = 0


def sampling_params(g: GenerationHyperparameters, remaining: int, generated: int) -> dict[str, Any]:
    """SGLang ``sampling_params`` for ``remaining`` more tokens after ``generated`` ones."""
    top_k = -1 if g.top_k <= 0 or g.top_k >= _TOP_K_OFF else int(g.top_k)
    params: dict[str, Any] = {
        "max_new_tokens": remaining,
        "min_new_tokens": min(remaining, max(0, g.min_new_tokens - generated)),
        "temperature": 0.0 if g.greedy else float(g.temperature),
        "top_p": float(g.top_p),
        "top_k": top_k,
        "stop_token_ids": list(g.stop_token_ids),
        "ignore_eos": bool(g.ignore_eos),
        "skip_special_tokens": bool(g.skip_special_tokens),
        "frequency_penalty": float(g.frequency_penalty),
    }
    if g.stop:
        params["stop"] = list(g.stop)
    return params


def parse_generate(data: Any) -> tuple[list[int], list[float], dict[str, Any]]:
    """Tokens, logprobs and finish_reason from a non-streaming ``/generate`` answer."""
    if isinstance(data, list):
        data = data[0]
    try:
        meta = data["meta_info"]
        pairs = meta["output_token_logprobs"] or []
        tokens = [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) for p in pairs]
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise EngineRequestError(f"unexpected /generate answer: {str(data)[:300]}") from exc
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, str):
        finish = {"type": finish}
    return tokens, logprobs, finish


class SGLangEngine(InferenceEngine):
    """HTTP client for one or more SGLang servers (see the module docstring)."""

    def __init__(
        self,
        base_urls: list[str],
        tokenizer_path: str | None = None,
        request_timeout: float = 3600,
        max_retries: int = 3,
        backoff_base: float = 0.5,
        backoff_max: float = 10.0,
        health_timeout: float = 300,
        *,
        failure_threshold: int = 2,
        down_cooldown: float = 30.0,
        pause_drain_timeout: float = 10.0,
        max_sticky: int = 100_000,
    ) -> None:
        if not base_urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        self.servers = [_Server(url.rstrip("/")) for url in base_urls]
        self.tokenizer_path = tokenizer_path
        self.request_timeout = request_timeout
        self.max_retries = max_retries
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.health_timeout = health_timeout
        self.failure_threshold = failure_threshold
        self.down_cooldown = down_cooldown
        self.pause_drain_timeout = pause_drain_timeout
        self.max_sticky = max_sticky
        self.stats = SGLangEngineStats()
        self._version = 0
        self._sticky: OrderedDict[str, _Server] = OrderedDict()
        self._rotation = 0
        self._session: aiohttp.ClientSession | None = None
        self._tokenizer: Any = None
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._calls = 0  # /generate posts in flight
        self._drained = asyncio.Event()
        self._drained.set()

    # ----------------------------------------------------------------- lifecycle

    @property
    def tokenizer(self) -> Any:
        """``AutoTokenizer`` from ``tokenizer_path``, or None when no path was given."""
        if self._tokenizer is None and self.tokenizer_path:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        return self._tokenizer

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection cap: SGLang queues requests itself, a client-side cap would hide load.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def start(self) -> None:
        """Wait until every server answers ``/health`` with 200.

        Raises ``EngineUnavailableError`` naming the servers still unhealthy after
        ``health_timeout`` seconds.
        """
        deadline = time.monotonic() + self.health_timeout
        healthy = await asyncio.gather(*(self._wait_healthy(s, deadline) for s in self.servers))
        bad = [s.url for s, ok in zip(self.servers, healthy) if not ok]
        if bad:
            raise EngineUnavailableError(f"SGLang servers not healthy after {self.health_timeout}s: {bad}")

    async def _wait_healthy(self, server: _Server, deadline: float) -> bool:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                timeout = aiohttp.ClientTimeout(total=min(5.0, left))
                async with self._client().get(f"{server.url}/health", timeout=timeout) as resp:
                    if resp.status == 200:
                        return True
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass  # not up yet: keep polling until the deadline
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------- versions

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    async def pause(self) -> None:
        """Abort generation on every server; returns once the aborted chunks came back.

        New and resubmitted requests wait locally until ``resume``.
        """
        self._unpaused.clear()
        await self._broadcast("/pause_generation", {"mode": "abort"}, self._reachable())
        try:
            await asyncio.wait_for(self._drained.wait(), self.pause_drain_timeout)
        except asyncio.TimeoutError:
            logger.warning("%d /generate calls still running %.0fs after pause", self._calls,
                           self.pause_drain_timeout)

    async def update_weights(self, update: WeightUpdate) -> None:
        """``/update_weights_from_disk`` on every server, then set the version.

        Servers that fail are excluded until a later update succeeds on them; raises
        ``EngineUnavailableError`` when none succeeded (version unchanged).
        """
        body = {"model_path": update.path, "weight_version": str(update.version)}
        results = await self._broadcast("/update_weights_from_disk", body, self.servers)
        for server, result in zip(self.servers, results):
            server.weights_ok = isinstance(result, dict) and bool(result.get("success"))
            if not server.weights_ok:
                logger.error("weight update to version %d failed on %s: %s", update.version, server.url, result)
        if not any(s.weights_ok for s in self.servers):
            raise EngineUnavailableError(f"weight update to version {update.version} failed on every server")
        self._version = update.version

    async def resume(self) -> None:
        """``/continue_generation`` on every server, then release waiting requests.

        A server that cannot be continued is not used until a later ``resume`` reaches it.
        """
        servers = self._reachable()
        results = await self._broadcast("/continue_generation", {}, servers)
        for server, result in zip(servers, results):
            server.running_ok = not isinstance(result, BaseException)
        self._unpaused.set()

    def _reachable(self) -> list[_Server]:
        now = time.monotonic()
        return [s for s in self.servers if s.down_until <= now]

    async def _broadcast(self, path: str, body: dict[str, Any], servers: list[_Server]) -> list[Any]:
        """POST to each server; one entry per server: the JSON answer or the exception."""
        results = await asyncio.gather(*(self._control(s, path, body) for s in servers), return_exceptions=True)
        for server, result in zip(servers, results):
            if isinstance(result, BaseException):
                logger.warning("%s on %s failed: %r", path, server.url, result)
        return list(results)

    async def _control(self, server: _Server, path: str, body: dict[str, Any]) -> Any:
        # A server already marked down gets one try: retrying it would only delay the others.
        attempts = 1 if server.down_until > time.monotonic() else self.max_retries + 1
        for attempt in range(attempts):
            try:
                return await self._post(server, path, body)
            except (aiohttp.ClientError, asyncio.TimeoutError, _Retryable):
                if attempt + 1 == attempts:
                    raise
                await asyncio.sleep(self._backoff(attempt))
        raise AssertionError("unreachable")

    async def _post(self, server: _Server, path: str, body: dict[str, Any]) -> Any:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        async with self._client().post(f"{server.url}{path}", json=body, timeout=timeout) as resp:
            text = await resp.text()
            if resp.status >= 500:
                raise _Retryable(f"HTTP {resp.status} from {server.url}{path}: {text[:300]}")
            if resp.status >= 400:
                # SGLang reports a failed weight update as 400 with {"success": false, ...}.
                if path == "/update_weights_from_disk":
                    return {"success": False, "message": text[:300]}
                raise EngineRequestError(f"HTTP {resp.status} from {server.url}{path}: {text[:300]}")
            return await resp.json(content_type=None)

    # ----------------------------------------------------------------- generation

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for ``req``, resuming across pauses (see the module docstring)."""
        checked_input_ids(req.input_ids)  # a malformed request fails here, alone, with its cause
        g = req.gconfig
        budget = g.budget(len(req.input_ids))
        started = time.monotonic()
        ttft = float("inf")
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reason: StopReason = "length"  # also for an abort that used up the budget
        empty_aborts = 0
        while len(tokens) < budget:
            payload = self._payload(req, tokens, budget)
            chunk, chunk_lps, finish = parse_generate(await self._generate(req.rid, payload))
            paused_abort = not self._unpaused.is_set()
            version = self._version
            chunk = chunk[: budget - len(tokens)]  # never trust a server past the budget
            tokens += chunk
            logprobs += chunk_lps[: len(chunk)]
            versions += [version] * len(chunk)
            if chunk and ttft == float("inf"):
                ttft = time.monotonic() - started
            kind = finish.get("type")
            if kind in ("stop", "length"):
                reason = kind
                break
            if kind != "abort":
                raise EngineRequestError(f"unknown finish_reason {finish!r} for rid {req.rid}")
            empty_aborts = 0 if chunk or paused_abort else empty_aborts + 1
            await self._after_abort(req.rid, finish, empty_aborts, paused_abort)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=versions,
            stop_reason=reason,
            latency=time.monotonic() - started,
            ttft=ttft,
            tokenizer=req.tokenizer,
        )

    async def _after_abort(self, rid: str, finish: dict[str, Any], empty_aborts: int, paused: bool) -> None:
        """Decide whether an abort is a pause to resume from, or an error to raise."""
        self.stats.resubmissions += 1
        if paused:
            return  # a weight-update pause: _generate waits for resume
        status = finish.get("status_code")
        if isinstance(status, int) and 400 <= status < 500:
            raise EngineRequestError(f"rid {rid} aborted by the server: {finish!r}")
        if empty_aborts > self.max_retries:
            raise EngineRequestError(f"rid {rid} aborted {empty_aborts} times without progress: {finish!r}")
        if empty_aborts:
            # Someone else paused the server, or it is shedding load: do not spin.
            await asyncio.sleep(self._backoff(empty_aborts - 1))

    def _payload(self, req: ModelRequest, generated: list[int], budget: int) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "input_ids": list(req.input_ids) + generated,
            "sampling_params": sampling_params(req.gconfig, budget - len(generated), len(generated)),
            "return_logprob": True,
            "rid": req.rid,
        }
        if req.image_data:
            payload["image_data"] = req.image_data
        return payload

    async def _generate(self, rid: str, payload: dict[str, Any]) -> Any:
        """POST /generate with retries and failover; waits while the engine is paused."""
        last_error: BaseException | None = None
        for attempt in range(self.max_retries + 1):
            await self._unpaused.wait()
            server = self._pick(rid, last_error)
            try:
                return await self._tracked_post(server, payload)
            except (aiohttp.ClientError, asyncio.TimeoutError, _Retryable) as exc:
                last_error = exc
                self._record_failure(server, exc)
            if attempt < self.max_retries:
                await asyncio.sleep(self._backoff(attempt))
        raise EngineUnavailableError(
            f"/generate for rid {rid} failed after {self.max_retries + 1} attempts: {last_error!r}"
        )

    async def _tracked_post(self, server: _Server, payload: dict[str, Any]) -> Any:
        server.inflight += 1
        self._calls += 1
        self._drained.clear()
        self.stats.http_attempts += 1
        try:
            data = await self._post(server, "/generate", payload)
        finally:
            server.inflight -= 1
            self._calls -= 1
            if self._calls == 0:
                self._drained.set()
        server.failures = 0
        return data

    def _pick(self, rid: str, last_error: BaseException | None) -> _Server:
        now = time.monotonic()
        usable = [s for s in self.servers if s.usable(now)]
        if not usable:
            states = {s.url: self._state(s, now) for s in self.servers}
            raise EngineUnavailableError(f"no SGLang server available {states}; last error: {last_error!r}")
        server = self._sticky.get(rid)
        if server is None or server not in usable:
            # Fewest in flight; the rotating tie-break spreads a burst of new requests.
            self._rotation += 1
            n = len(usable)
            server = min(enumerate(usable), key=lambda p: (p[1].inflight, (p[0] - self._rotation) % n))[1]
        self._sticky[rid] = server
        self._sticky.move_to_end(rid)
        while len(self._sticky) > self.max_sticky:
            self._sticky.popitem(last=False)
        return server

    @staticmethod
    def _state(server: _Server, now: float) -> str:
        if not server.weights_ok:
            return "weight update failed"
        if not server.running_ok:
            return "continue_generation failed"
        return f"down for {server.down_until - now:.0f}s more"

    def _record_failure(self, server: _Server, exc: BaseException) -> None:
        self.stats.http_failures += 1
        server.failures += 1
        logger.warning("SGLang %s failed (%d in a row): %r", server.url, server.failures, exc)
        if server.failures >= self.failure_threshold and server.down_until <= time.monotonic():
            server.down_until = time.monotonic() + self.down_cooldown
            self.stats.servers_marked_down += 1
            logger.error("SGLang %s marked down for %.0fs", server.url, self.down_cooldown)

    def _backoff(self, attempt: int) -> float:
        """Capped exponential backoff with "equal jitter": half fixed, half random."""
        delay = min(self.backoff_max, self.backoff_base * (2**attempt))
        return delay / 2 + random.uniform(0, delay / 2)

    def server_for(self, rid: str) -> str | None:
        """The URL a ``rid`` is pinned to, if any (for tests and debugging)."""
        server = self._sticky.get(rid)
        return server.url if server else None

"""A local stand-in for an SGLang 0.5.23 server, speaking SGLang's native HTTP API.

A real SGLang server needs a GPU, so CPU tests run against this stand-in. It follows what
SGLang 0.5.23's own request and server code does (``shared/reference/sglang-http.md``), point
by point; ``scripts/check_sglang.py`` runs the same checks against a real server (and, in
``tests/unit/test_check_sglang.py``, against this one):

* ``/generate`` takes ``input_ids`` (the server models ``--skip-tokenizer-init``: no ``text``;
  ``stop`` strings and ``min_new_tokens`` > 0 are refused with 400, as SGLang refuses them
  without a tokenizer). Unknown top-level keys are ignored; an unknown ``sampling_params`` key
  is 400 "unknown field" (SGLang >= 0.5.22). ``image_data`` for the one ``input_ids`` prompt
  must be a string or a list of strings or dicts (SGLang's ``ImageDataInputItem`` forms that JSON
  can carry), else 400. A ``rid`` the server still holds is 400
  "Duplicate request ID detected"; a dropped client is noticed only every
  ``disconnect_check_seconds`` (SGLang: ~4 s), so its rid stays held until then.
* ``meta_info.weight_version`` reports the version given to ``/update_weights_from_disk``
  (``"default"`` before the first load), stamped when the answer is written.
* ``/pause_generation`` (mode abort, the default) aborts every running request and answers only
  once those were answered, polling every ``pause_poll_seconds`` (SGLang: 1 s); ``in_place`` and
  ``retract`` hold running requests instead. While paused, a new request waits at the gate (it
  is neither aborted nor answered) until ``/continue_generation``. A load waits for running
  requests to end (SGLang's model-update lock) and new requests wait for the load.
* ``/health`` generates a token: while paused it answers 503 after ``health_pause_timeout``
  (SGLang: ~20 s). ``/model_info`` (and ``/get_weight_version``) answer at once, paused or not.
* A NaN logprob is written as JSON ``null`` (hook ``null_logprob_next``).
* Any number of clients at once; per request, one token every ``token_delay`` seconds.
* ``go_down`` (and leaving ``async with``) ends every handler at once, as a crash would: none
  keeps running on (aiohttp alone lets a handler whose client left run to its end, e.g. a pause
  polling every ``pause_poll_seconds``, which would outlive the test and hold the pause lock).

Tokens are pseudo-random ids in ``[3, vocab_size)`` drawn from the weights, the context and
(unless greedy) the rid; logprobs are negative multiples of 2**-16 (exact in float32). Every
token is recorded in :attr:`ledger` with the weights that produced it, so tests can check
each tag a client gives it.

Test hooks: ``fail_next`` (HTTP 5xx), ``drop_next`` (close the connection without an answer),
``go_down``/``come_up`` (a crash and a restart, optionally with fresh weights), ``healthy``,
``stop_at``, ``abort_after``, ``fail_updates``, ``load_delay``, ``null_logprob_next``.
Records: ``requests`` (bodies received), ``hits``, ``refusals`` (400s by reason),
``loads`` (one per completed load), ``tokens_out``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from harness.services import free_port
from harness.token_ledger import TokenLedger
from rollstream.engines.server_http import parse_label


SAMPLING_KEYS = frozenset({
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "no_stop_trim", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "n", "sampling_seed", "json_schema", "regex", "ebnf",
    "spaces_between_special_tokens", "stop_regex", "custom_params",
})
INITIAL_VERSION = "default"
LOGPROB_STEP = 2.0**-16


def _error(status: int, message: str) -> web.Response:
    """SGLang's error body for a refused /generate (FastAPI handler catching ValueError)."""
    return web.json_response({"error": {"message": message}}, status=status)


@dataclass
class _Running:
    """A request past the gate (it holds SGLang's model-update reader lock)."""

    rid: str
    abort: str | None = None  # why it must stop, once set


@dataclass(frozen=True)
class Load:
    """One completed ``/update_weights_from_disk``."""

    weight_version: str
    model_path: str
    started: float
    finished: float

    @property
    def version(self) -> int | None:
        """The rollstream version its label names."""
        return parse_label(self.weight_version).version


class FakeSGLangServer:
    """``async with FakeSGLangServer() as server:`` serves on ``server.url`` (a free port)."""

    @property
    def version(self) -> int | None:
        """The rollstream version its weight label names (``weight_version`` is the label itself)."""
        return parse_label(self.weight_version).version

    def __init__(
        self, *, token_delay: float = 0.002, vocab_size: int = 1000, eos_token_id: int = 2, seed: int = 0,
        host: str = "127.0.0.1", port: int | None = None, pause_poll_seconds: float = 0.05,
        health_pause_timeout: float = 20.0, disconnect_check_seconds: float = 4.0, load_delay: float = 0.0,
    ) -> None:
        self.token_delay = token_delay
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.host = host
        self.port = port or free_port(host)
        self.pause_poll_seconds = pause_poll_seconds
        self.health_pause_timeout = health_pause_timeout
        self.disconnect_check_seconds = disconnect_check_seconds
        self.load_delay = load_delay
        self.weight_version = INITIAL_VERSION
        self.model_path = "fake-model"
        self.ledger = TokenLedger()
        self.requests: list[dict[str, Any]] = []
        self.hits: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self.loads: list[Load] = []
        self.tokens_out = 0
        self.healthy = True
        self.stop_at: int | None = None  # emit eos as this output index
        self.abort_after: int | None = None  # abort each request after this many tokens
        self.fail_updates = False
        self.null_logprob_next = 0  # this many next requests get a null logprob on their first token
        self.loading = asyncio.Event()  # set while a load runs (tests wait on it)
        self._fail: list[int] = [0, 500]  # remaining count, status
        self._drop = 0
        self._held: set[str] = set()  # rids the server holds (SGLang's rid_to_state)
        self._running: dict[str, _Running] = {}
        self._paused = False
        self._pause_mode = "abort"
        self._open_gate = asyncio.Event()  # set when neither paused nor loading
        self._open_gate.set()
        self._control = asyncio.Lock()  # SGLang's is_pause_cond: pause and continue exclude each other
        self._runner: web.AppRunner | None = None
        self._open: set[asyncio.BaseTransport] = set()
        self._handlers: set[asyncio.Task[Any]] = set()  # tasks running a request handler now

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def paused(self) -> bool:
        return self._paused

    # ------------------------------------------------------------------ hooks

    def fail_next(self, n: int, status: int = 500) -> None:
        """The next ``n`` ``/generate`` calls answer HTTP ``status``."""
        self._fail = [n, status]

    def drop_next(self, n: int) -> None:
        """The next ``n`` ``/generate`` calls get their connection closed without an answer."""
        self._drop = n

    async def go_down(self) -> None:
        """Stop listening, cut open connections and end every running handler at once, like a crash."""
        if self._runner is not None:
            for transport in list(self._open):  # a graceful shutdown would let handlers finish
                transport.abort()
            for running in self._running.values():
                running.abort = "server down"
            handlers = list(self._handlers)
            for task in handlers:
                task.cancel()
            if handlers:  # none awaits anything on its way out: one loop turn or two
                await asyncio.wait(handlers, timeout=5.0)
            await self._runner.cleanup()
            self._runner = None

    @property
    def handlers_running(self) -> int:
        """Request handlers running now (0 after ``go_down``)."""
        return len(self._handlers)

    async def come_up(self, *, fresh: bool = False) -> None:
        """Listen again on the same port; ``fresh``: as a restarted process, back on the
        weights it was started with, running, holding no request."""
        if fresh:
            self.weight_version, self.model_path = INITIAL_VERSION, "fake-model"
            self._paused = False
            self._open_gate.set()
            self._held.clear()
            self._running.clear()
        if self._runner is None:
            app = web.Application(middlewares=[self._track])
            app.add_routes(self._routes())
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.05)
            await self._runner.setup()
            await web.TCPSite(self._runner, self.host, self.port).start()

    async def __aenter__(self) -> FakeSGLangServer:
        await self.come_up()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._open_gate.set()
        await self.go_down()

    def _routes(self) -> list[web.RouteDef]:
        return [
            web.get("/health", self._health),
            web.get("/health_generate", self._health),
            web.get("/ready", self._ready),
            web.get("/model_info", self._model_info),
            web.get("/get_model_info", self._model_info),
            web.get("/get_weight_version", self._get_weight_version),
            web.get("/server_info", self._server_info),
            web.post("/generate", self._generate),
            web.post("/pause_generation", self._pause),
            web.post("/continue_generation", self._continue),
            web.post("/update_weights_from_disk", self._update_weights),
        ]

    @web.middleware
    async def _track(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            return await handler(request)
        finally:
            self._handlers.discard(task)

    # -------------------------------------------------------------- control

    async def _health(self, request: web.Request) -> web.Response:
        self.hits["health"] += 1
        if not self.healthy:
            return web.Response(status=503)
        try:  # SGLang's health check generates one token: it waits at the gate like any request
            async with asyncio.timeout(self.health_pause_timeout):  # not wait_for: it can lose a cancel on 3.11
                await self._open_gate.wait()
        except TimeoutError:
            return web.Response(status=503)
        await asyncio.sleep(self.token_delay)
        return web.Response(status=200)

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self._paused else 200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tokenizer_path": None, "is_generation": True,
                                  "weight_version": self.weight_version})

    async def _get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.23", "skip_tokenizer_init": True,
                                  "weight_version": self.weight_version})

    async def _json_body(self, request: web.Request) -> dict[str, Any] | None:
        try:
            body = await request.json()
        except ValueError:
            return None  # SGLang rejects an empty or non-JSON body too
        return body if isinstance(body, dict) else None

    async def _pause(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if body is None:
            return _error(400, "expected a JSON object body")
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _error(400, f"unknown pause mode {mode!r}")
        self.hits["pause"] += 1
        async with self._control:
            self._paused, self._pause_mode = True, mode
            self._open_gate.clear()
            while mode == "abort":  # like SGLang: abort all, answer once none is running
                for running in self._running.values():
                    running.abort = running.abort or "Abort all requests (pause_generation)"
                if not self._running:
                    break
                await asyncio.sleep(self.pause_poll_seconds)
        return web.json_response({"message": "Generation paused successfully."})

    async def _continue(self, request: web.Request) -> web.Response:
        if await self._json_body(request) is None:
            return _error(400, "expected a JSON object body")
        self.hits["continue"] += 1
        async with self._control:
            self._paused = False
            if not self.loading.is_set():
                self._open_gate.set()
        return web.json_response({"message": "Generation continued successfully."})

    async def _update_weights(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if body is None or "model_path" not in body:
            return _error(400, "model_path is required")
        self.hits["update"] += 1
        started = time.monotonic()
        self.loading.set()
        self._open_gate.clear()  # new requests wait for the model-update lock
        try:
            if body.get("abort_all_requests"):
                for running in self._running.values():
                    running.abort = "Abort all requests (update_weights)"
            while self._running:  # the writer lock waits for running requests
                await asyncio.sleep(self.pause_poll_seconds)
            await asyncio.sleep(self.load_delay)
            if self.fail_updates:
                return web.json_response(
                    {"success": False, "message": "Failed to load weights", "num_paused_requests": 0}, status=400)
            self.model_path = body["model_path"]
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
            self.loads.append(Load(self.weight_version, self.model_path, started, time.monotonic()))
        finally:
            self.loading.clear()
            if not self._paused:
                self._open_gate.set()
        return web.json_response(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})

    # ----------------------------------------------------------- generation

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.hits["generate"] += 1
        if self._drop > 0:
            self._drop -= 1
            assert request.transport is not None
            request.transport.close()  # the client sees a dropped connection
            return web.Response(status=500)
        if self._fail[0] > 0:
            self._fail[0] -= 1
            return _error(self._fail[1], "injected failure")
        body = await self._json_body(request)
        if body is None:
            return self._refuse("bad_body", "expected a JSON object body")
        self.requests.append(body)
        problem = self._check_prompt(body)
        if problem:
            return self._refuse(*problem)
        rid = str(body.get("rid") or f"auto-{random.getrandbits(64):x}")
        if rid in self._held:  # registered before the pause gate, as SGLang does
            return self._refuse("duplicate_rid", f"Duplicate request ID detected: {rid}")
        self._held.add(rid)
        transport = request.transport
        if transport is not None:
            self._open.add(transport)
        try:
            await self._open_gate.wait()  # paused or loading: wait here, neither aborted nor answered
            problem = self._check_sampling(body)  # SGLang builds its sampling params after the gate
            if problem:
                return self._refuse(*problem)
            running = self._running[rid] = _Running(rid)
            try:
                answer = await self._run(body, rid, running, request)
                if answer is None:  # the client went away: nobody to answer
                    return web.Response(status=204)
                return await self._write(request, answer)  # answered before the rid is released
            finally:
                self._running.pop(rid, None)
        finally:
            self._held.discard(rid)
            if transport is not None:
                self._open.discard(transport)

    @staticmethod
    async def _write(request: web.Request, answer: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(json.dumps(answer).encode())
        await response.write_eof()
        return response

    def _refuse(self, reason: str, message: str) -> web.Response:
        self.refusals[reason] += 1
        return _error(400, message)

    @staticmethod
    def _check_prompt(body: dict[str, Any]) -> tuple[str, str] | None:
        ids = body.get("input_ids")
        if "text" in body and ids is None:
            return "skip_tokenizer_init", "text prompts need a tokenizer: the server runs with --skip-tokenizer-init"
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            return "bad_body", "input_ids must be a non-empty list of ints"
        images = body.get("image_data")
        items = images if isinstance(images, list) else [images]
        if images is not None and not all(isinstance(i, (str, dict)) for i in items):
            return "bad_body", "image_data must be a string or a list of strings (one request: its images)"
        return None

    @staticmethod
    def _check_sampling(body: dict[str, Any]) -> tuple[str, str] | None:
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            return "bad_body", "sampling_params must be an object"
        unknown = sorted(set(params) - SAMPLING_KEYS)
        if unknown:
            return "unknown_sampling_key", f"unknown field(s) in sampling_params: {unknown}"
        if params.get("stop"):
            return "skip_tokenizer_init", "stop strings are not supported when skip_tokenizer_init is set"
        if (params.get("min_new_tokens") or 0) > 0:
            return "skip_tokenizer_init", "min_new_tokens is not supported when skip_tokenizer_init is set"
        max_new = params.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or max_new < 0:
            return "bad_body", "max_new_tokens must be a non-negative int"
        return None

    async def _run(
        self, body: dict[str, Any], rid: str, running: _Running, request: web.Request,
    ) -> dict[str, Any] | None:
        params = body.get("sampling_params") or {}
        context = list(body["input_ids"])
        prompt_len = len(context)
        max_new = params.get("max_new_tokens", 128)
        stop_ids = set(params.get("stop_token_ids") or []) | {self.eos_token_id}
        greedy = params.get("temperature", 1.0) == 0 or params.get("top_k") == 1
        started = last_check = time.monotonic()
        null_first = self.null_logprob_next > 0
        self.null_logprob_next -= int(null_first)
        out: list[tuple[float | None, int]] = []
        finish: dict[str, Any] = {"type": "length", "length": max_new}
        while True:
            if self.abort_after is not None and len(out) >= self.abort_after:
                finish = _abort("injected abort")
                break
            if len(out) >= max_new:  # SGLang checks length before stop tokens
                break
            await asyncio.sleep(self.token_delay)
            if self._paused and self._pause_mode != "abort":
                await self._open_gate.wait()  # in_place / retract: hold the request
            if running.abort:
                finish = _abort(running.abort)
                break
            if time.monotonic() - last_check >= self.disconnect_check_seconds:
                last_check = time.monotonic()
                if request.transport is None or request.transport.is_closing():
                    return None  # SGLang notices the dropped client only now, and aborts
            logprob, token = self._next_token(context, rid, greedy, len(out), stop_ids)
            self.ledger.record(context + [token], logprob, self.weight_version)
            out.append((None if null_first and not out else logprob, token))
            context.append(token)
            self.tokens_out += 1
            if not params.get("ignore_eos") and token in stop_ids:
                finish = {"type": "stop", "matched": token}
                break
        meta = {
            "id": rid, "finish_reason": finish, "prompt_tokens": prompt_len, "completion_tokens": len(out),
            "cached_tokens": 0, "weight_version": self.weight_version, "e2e_latency": time.monotonic() - started,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in out]
        return {"text": "", "output_ids": [t for _, t in out], "meta_info": meta}

    def _next_token(self, context: list[int], rid: str, greedy: bool, index: int,
                    stop_ids: set[int]) -> tuple[float, int]:
        if self.stop_at is not None and index == self.stop_at:
            return -0.5, self.eos_token_id
        source = f"{context[-4:]}" if greedy else rid
        rng = random.Random(f"{self.seed}|{self.weight_version}|{source}|{len(context)}")
        token = rng.randrange(3, self.vocab_size)
        return -rng.randint(1, 5 * 2**16) * LOGPROB_STEP, token


def _abort(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}

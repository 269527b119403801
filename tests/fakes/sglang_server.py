"""A small local stand-in for an SGLang server, speaking SGLang's native HTTP API.

A real SGLang server needs a GPU, so CPU tests run against this fake. It follows the documented
API of SGLang 0.5.x (see ``shared/reference/sglang-http.md``): ``/health``, ``/generate`` with
``input_ids`` (as a server started with ``--skip-tokenizer-init``), ``/pause_generation``,
``/continue_generation`` and ``/update_weights_from_disk``. Like SGLang >= 0.5.23 it answers
HTTP 400 "unknown field" for a ``sampling_params`` key SGLang does not know (e.g. ``max_tokens``).

Tokens are deterministic pseudo-random ids in ``[3, vocab_size)`` derived from the context and
the weight version; logprobs are deterministic negative floats. Each token takes
``token_delay`` seconds, so a pause can cut a request mid-way. ``scripts/check_sglang.py``
runs the same checks against a real server.

Test hooks: ``fail_next`` (HTTP 5xx), ``drop_next`` (close the connection without an answer),
``go_down``/``come_up`` (stop/start listening on the same port), ``healthy``, ``stop_at``,
``abort_after``, ``fail_updates``; ``requests`` holds every ``/generate`` body received and
``tokens_out`` counts generated tokens.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections import Counter
from typing import Any

from aiohttp import web

SAMPLING_KEYS = frozenset({
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "no_stop_trim", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "n", "sampling_seed", "json_schema", "regex", "ebnf",
    "spaces_between_special_tokens", "stop_regex", "custom_params",
})
REQUEST_KEYS = frozenset({
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream", "lora_path",
    "image_data", "video_data", "audio_data", "modalities", "return_hidden_states", "priority",
})


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "code": status}, status=status)


class FakeSGLangServer:
    """``async with FakeSGLangServer() as server:`` serves on ``server.url`` (a free port)."""

    def __init__(
        self,
        *,
        token_delay: float = 0.002,
        vocab_size: int = 1000,
        eos_token_id: int = 2,
        seed: int = 0,
        weight_version: str = "default",
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        self.token_delay = token_delay
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.weight_version = weight_version
        self.model_path = "fake-model"
        self.host = host
        self.port = port or free_port(host)
        self.requests: list[dict[str, Any]] = []
        self.hits: Counter[str] = Counter()
        self.tokens_out = 0  # tokens generated so far, over all requests
        self.healthy = True
        self.stop_at: int | None = None  # emit eos as this output index
        self.abort_after: int | None = None  # abort each request after this many tokens
        self.fail_updates = False
        self._fail: list[int] = [0, 500]  # remaining count, status
        self._drop = 0
        self._paused = False
        self._pause_mode = "abort"
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._abort_epoch = 0
        self._runner: web.AppRunner | None = None
        self._open: set[asyncio.BaseTransport] = set()  # transports of running /generate calls

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ hooks

    def fail_next(self, n: int, status: int = 500) -> None:
        """The next ``n`` ``/generate`` calls answer HTTP ``status``."""
        self._fail = [n, status]

    def drop_next(self, n: int) -> None:
        """The next ``n`` ``/generate`` calls get their connection closed without an answer."""
        self._drop = n

    async def go_down(self) -> None:
        """Stop listening and cut open connections at once, like a crash (in-flight requests fail)."""
        if self._runner is not None:
            # aiohttp's graceful shutdown would let running handlers finish: cut them instead.
            for transport in list(self._open):
                transport.abort()
            self._abort_epoch += 1
            await self._runner.cleanup()
            self._runner = None

    async def come_up(self) -> None:
        """Listen again on the same port."""
        if self._runner is None:
            app = web.Application()
            app.add_routes(self._routes())
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.05)
            await self._runner.setup()
            await web.TCPSite(self._runner, self.host, self.port).start()

    async def __aenter__(self) -> FakeSGLangServer:
        await self.come_up()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._unpaused.set()
        await self.go_down()

    def _routes(self) -> list[web.RouteDef]:
        return [
            web.get("/health", self._health),
            web.get("/health_generate", self._health),
            web.get("/ready", self._ready),
            web.get("/model_info", self._model_info),
            web.post("/generate", self._generate),
            web.post("/pause_generation", self._pause),
            web.post("/continue_generation", self._continue),
            web.post("/update_weights_from_disk", self._update_weights),
        ]

    # -------------------------------------------------------------- handlers

    async def _health(self, request: web.Request) -> web.Response:
        self.hits["health"] += 1
        return web.Response(status=200 if self.healthy else 503)

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self._paused else 200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "is_generation": True})

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
        self.hits["pause"] += 1
        self._pause_mode = body.get("mode", "abort")
        if self._pause_mode not in ("abort", "retract", "in_place"):
            return _error(400, f"unknown pause mode {self._pause_mode!r}")
        self._paused = True
        self._unpaused.clear()
        if self._pause_mode == "abort":
            self._abort_epoch += 1
        return web.json_response({"message": "Generation paused successfully."})

    async def _continue(self, request: web.Request) -> web.Response:
        if await self._json_body(request) is None:
            return _error(400, "expected a JSON object body")
        self.hits["continue"] += 1
        self._paused = False
        self._unpaused.set()
        return web.json_response({"message": "Generation continued successfully."})

    async def _update_weights(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if body is None or "model_path" not in body:
            return _error(400, "model_path is required")
        self.hits["update"] += 1
        if self.fail_updates:
            return web.json_response(
                {"success": False, "message": "Failed to load weights", "num_paused_requests": 0}, status=400
            )
        self.model_path = body["model_path"]
        self.weight_version = str(body.get("weight_version") or self.weight_version)
        if body.get("abort_all_requests"):
            self._abort_epoch += 1
        return web.json_response(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

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
            return _error(400, "expected a JSON object body")
        problem = self._validate(body)
        if problem:
            return _error(400, problem)
        self.requests.append(body)
        transport = request.transport
        if transport is not None:
            self._open.add(transport)
        try:
            await self._unpaused.wait()  # like SGLang: new requests wait while paused
            return web.json_response(await self._run(body))
        finally:
            if transport is not None:
                self._open.discard(transport)

    def _validate(self, body: dict[str, Any]) -> str | None:
        unknown = sorted(set(body) - REQUEST_KEYS)
        if unknown:
            return f"unknown field(s) in request: {unknown}"
        params = body.get("sampling_params") or {}
        unknown = sorted(set(params) - SAMPLING_KEYS)
        if unknown:
            return f"unknown field(s) in sampling_params: {unknown}"
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            return "input_ids must be a non-empty list of ints (server runs with --skip-tokenizer-init)"
        max_new = params.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or max_new < 0:
            return "max_new_tokens must be a non-negative int"
        return None

    async def _run(self, body: dict[str, Any]) -> dict[str, Any]:
        params = body.get("sampling_params") or {}
        context = list(body["input_ids"])
        prompt_len = len(context)
        max_new = params.get("max_new_tokens", 128)
        min_new = params.get("min_new_tokens", 0)
        stop_ids = set(params.get("stop_token_ids") or []) | {self.eos_token_id}
        ignore_eos = bool(params.get("ignore_eos", False))
        epoch, started = self._abort_epoch, time.monotonic()
        out: list[tuple[float, int]] = []
        finish: dict[str, Any] = {"type": "length", "length": max_new}
        while True:
            if self.abort_after is not None and len(out) >= self.abort_after:
                finish = {"type": "abort", "message": "injected abort"}
                break
            if len(out) >= max_new:  # SGLang checks length before stop tokens
                break
            await asyncio.sleep(self.token_delay)
            if self._paused and self._pause_mode != "abort":
                await self._unpaused.wait()  # in_place / retract: hold the request
            if self._abort_epoch != epoch:
                finish = {"type": "abort", "message": "Abort in waiting queue or running batch"}
                break
            logprob, token = self._next_token(context, len(out), min_new, stop_ids)
            out.append((logprob, token))
            context.append(token)
            self.tokens_out += 1
            if not ignore_eos and token in stop_ids and len(out) < max_new:
                finish = {"type": "stop", "matched": token}
                break
        return {
            "text": "",
            "output_ids": [t for _, t in out],
            "meta_info": {
                "id": body.get("rid"),
                "finish_reason": finish,
                "prompt_tokens": prompt_len,
                "completion_tokens": len(out),
                "cached_tokens": 0,
                "weight_version": self.weight_version,
                "e2e_latency": time.monotonic() - started,
                "output_token_logprobs": [[lp, t, None] for lp, t in out] if body.get("return_logprob") else None,
            },
        }

    def _next_token(self, context: list[int], index: int, min_new: int, stop_ids: set[int]) -> tuple[float, int]:
        if self.stop_at is not None and index == self.stop_at and index >= min_new:
            return -0.5, self.eos_token_id
        rng = random.Random(f"{self.seed}|{self.weight_version}|{len(context)}|{context[-4:]}")
        token = rng.randrange(3, self.vocab_size)
        while token in stop_ids and index < min_new:
            token = rng.randrange(3, self.vocab_size)
        return -round(rng.uniform(0.01, 5.0), 6), token

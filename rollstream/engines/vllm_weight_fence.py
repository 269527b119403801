"""The weight fence: an ASGI middleware that runs INSIDE the vLLM API server.

Start the server with ``--middleware rollstream.engines.vllm_weight_fence.WeightFence`` (the
module imports nothing of rollstream and nothing beyond the standard library;
``rollstream.dev.vllm_server`` puts it on the server's ``PYTHONPATH`` beside the worker extension).

Every call that changes what a server generates with, or how its tokens are labelled (pause,
resume, the weight-version label, a weight load through ``/collective_rpc``, a prefix-cache
reset, vLLM's own weight-transfer routes, sleep and wake-up), must carry its sender's fencing
epoch in the ``X-Rollstream-Epoch`` header: the sync owner's lease token, which grows
with every new lease grant (``rollstream.state.server_lease``). Callers may rely on:

* a call whose epoch is older than the newest one this server accepted is refused (HTTP 409)
  and changes nothing: a former sync owner that stalled past its lease (a GC pause, a stopped
  process, a slow network) can no longer pause, load, label or continue a server its successor
  took over, whatever the order in which its calls arrive;
* fenced calls run one at a time (a call's check and its effect are one atomic action), so no fenced
  call of one sync owner interleaves with another's;
* a fenced call without the header is refused (HTTP 428), so nothing can bypass the fence;
* ``GET /rollstream/fence`` answers ``{"epoch", "extension", "prefix_caching"}``: the newest
  accepted epoch (0: none yet), whether rollstream's worker extension answers, and whether the
  server caches prefixes across requests.

The fence lives in the API server process: it holds for vLLM's single API server (the default;
not with ``--api-server-count`` above 1), and a restarted server starts with no fence, and
with its launch weights.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

FENCE_HEADER = "x-rollstream-epoch"
FENCE_PATH = "/rollstream/fence"
FENCED_PATHS = frozenset({
    "/pause", "/resume", "/update_weight_version", "/collective_rpc", "/reset_prefix_cache",
    "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
    "/sleep", "/wake_up",
})

Scope = dict[str, Any]


class WeightFence:
    """The middleware; see the module docstring."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.epoch = 0
        self._lock: asyncio.Lock | None = None  # made on the server's event loop

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path == FENCE_PATH and scope["method"] == "GET":
            await _answer(send, 200, await self._describe(scope))
            return
        if path not in FENCED_PATHS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        epoch = _epoch(scope)
        if epoch is None:
            await _answer(send, 428, _error(
                f"{path} changes the weights a server generates with: send the sync owner's fencing "
                f"epoch in the X-Rollstream-Epoch header"))
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if epoch < self.epoch:
                await _answer(send, 409, _error(
                    f"{path} refused: fencing epoch {epoch} is older than {self.epoch}, the newest this server "
                    f"accepted (a newer sync owner took it over)"))
                return
            self.epoch = epoch
            await self._run(scope, receive, send)

    async def _run(self, scope: Scope, receive: Any, send: Any) -> None:
        """The call itself; an error before its answer started is answered here (500, with the
        error) instead of reaching the server's outermost handler, which would drop the
        connection after answering, and the caller's next call on it with it."""
        started = False

        async def tracking(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception as exc:
            if started:
                raise
            await _answer(send, 500, _error(f"{scope['path']} failed: {type(exc).__name__}: {exc}"[:4000]))

    async def _describe(self, scope: Scope) -> dict[str, Any]:
        state = getattr(scope.get("app"), "state", None)
        answer: dict[str, Any] = {"epoch": self.epoch, "extension": None, "prefix_caching": None}
        config = getattr(state, "vllm_config", None)
        if config is not None:
            answer["prefix_caching"] = bool(config.cache_config.enable_prefix_caching)
        engine = getattr(state, "engine_client", None)
        if engine is not None:
            try:
                answer["extension"] = [str(r) for r in await engine.collective_rpc("rollstream_ping")]
            except Exception as exc:  # the extension is missing: the caller says how to start the server
                answer["extension_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return answer


def _epoch(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name.decode("latin-1").lower() == FENCE_HEADER:
            try:
                return int(value.decode("latin-1"))
            except ValueError:
                return None
    return None


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message}}


async def _answer(send: Any, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})

"""Liveness and readiness of a tier process, served next to its Prometheus metrics.

One HTTP server per process on ``metrics.port`` (none without a port) answers:

- ``GET /metrics``: the Prometheus metrics (``rollstream.runtime.metrics``);
- ``GET /livez``: 200 while the tier's event loop turns (a heartbeat task stamps the time every
  second); 503 once the loop has not turned for ``metrics.liveness_timeout_seconds`` (stuck:
  restart the process). A process that ended answers nothing, which probes count as a failure;
- ``GET /readyz``: 200 from the moment the tier said it is ready (topics checked, clients
  started, consuming or publishing) until it starts stopping; 503 before and after, the body
  saying why. A tier that waits for Kafka or Redis at start is live but not ready.

Callers may rely on: ``mark_ready()`` / ``mark_not_ready(why)`` are safe from any thread and
idempotent; ``heartbeat()`` runs until cancelled (``heartbeat_thread()``: until its event is
set, for a process without an event loop); ``serve_health(None, ...)`` does nothing.
The state is per process (like Prometheus' default registry): one tier per process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0


class Health:
    """What the probes answer; one per process (:data:`HEALTH`), replaceable in tests."""

    def __init__(self, liveness_timeout: float = 60.0) -> None:
        self.liveness_timeout = liveness_timeout
        self._lock = threading.Lock()
        self._beat = time.monotonic()
        self._ready = False
        self._why_not_ready = "starting"

    def beat(self) -> None:
        with self._lock:
            self._beat = time.monotonic()

    def mark_ready(self) -> None:
        with self._lock:
            if not self._ready:
                log.info("ready")
            self._ready, self._why_not_ready = True, ""

    def mark_not_ready(self, why: str) -> None:
        with self._lock:
            self._ready, self._why_not_ready = False, why

    def live(self) -> tuple[bool, str]:
        with self._lock:
            stuck = time.monotonic() - self._beat
        if stuck > self.liveness_timeout:
            return False, f"event loop stuck for {stuck:.0f}s (limit {self.liveness_timeout:.0f}s)"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        with self._lock:
            return self._ready, "ok" if self._ready else self._why_not_ready


HEALTH = Health()


def mark_ready() -> None:
    """The tier is doing its work (call once its clients are started); see the module docstring."""
    HEALTH.mark_ready()


def mark_not_ready(why: str) -> None:
    HEALTH.mark_not_ready(why)


async def heartbeat(health: Health | None = None, interval: float = HEARTBEAT_SECONDS) -> None:
    """Stamp ``health`` (default :data:`HEALTH`) every ``interval`` seconds until cancelled."""
    target = health or HEALTH
    while True:
        target.beat()
        await asyncio.sleep(interval)


def heartbeat_thread(health: Health | None = None, interval: float = HEARTBEAT_SECONDS) -> threading.Event:
    """Stamp ``health`` (default :data:`HEALTH`) every ``interval`` seconds from a daemon thread,
    for a process without an event loop (the example trainer, whose steps take as long as they
    take): ``/livez`` then says the process runs, as a container health check needs. Set the
    returned event to stop it."""
    target = health or HEALTH
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            target.beat()
            stop.wait(interval)

    threading.Thread(target=beat, name="health-heartbeat", daemon=True).start()
    return stop


def _handler(health: Health) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._answer(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
            elif path in ("/livez", "/readyz"):
                ok, why = health.live() if path == "/livez" else health.ready()
                self._answer(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
            else:
                self._answer(404, b"not found: /metrics, /livez, /readyz\n", "text/plain; charset=utf-8")

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # probes every few seconds would flood the tier's log

    return Handler


def serve_health(port: int | None, health: Health | None = None, host: str = "") -> ThreadingHTTPServer | None:
    """Serve ``/metrics``, ``/livez`` and ``/readyz`` on ``port`` in a daemon thread (None: no
    server). Returns the server (``shutdown()`` stops it)."""
    if port is None:
        return None
    server = ThreadingHTTPServer((host, port), _handler(health or HEALTH))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health-server", daemon=True).start()
    log.info("serving /metrics, /livez and /readyz on :%d", server.server_address[1])
    return server

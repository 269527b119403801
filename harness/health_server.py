"""A health endpoint served on a free local port for one block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from harness.services import free_port
from rollstream.runtime.health import Health, serve_health


@contextlib.contextmanager
def serving(health: Health) -> Iterator[int]:
    """``health`` served on a free local port (the port), shut down after."""
    port = free_port()
    server = serve_health(port, health, host="127.0.0.1")
    assert server is not None
    try:
        yield port
    finally:
        server.shutdown()
        server.server_close()

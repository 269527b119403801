"""Kafka, Redis and the tiny model for a run outside pytest's fixtures (the benchmarks), and
names and ports of one's own.

``services()`` resolves Kafka and Redis like the tests do (``KAFKA_BOOTSTRAP_SERVERS`` /
``REDIS_URL``, else a local broker from the cached jars and a local redis-server, or
testcontainers with ``ROLLSTREAM_DEV_SERVICES=testcontainers``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

from rollstream.dev.launcher import DevStack, dev_stack


def cache_dir() -> Path:
    root = os.environ.get("ROLLSTREAM_CACHE_DIR") or Path.home() / ".cache" / "rollstream"
    return Path(root).expanduser() / "bench"


def tokenizer_path() -> Path:
    """The project's offline tiny model (its tokenizer is what the tiers load), built once."""
    from rollstream.tiny.text_model import ensure_tiny_model

    return ensure_tiny_model(cache_dir() / "tiny-model")


@contextlib.contextmanager
def services(workdir: Path) -> Iterator[DevStack]:
    """Kafka and Redis for one benchmark run (stopped afterwards if started here)."""
    with dev_stack(workdir) as dev:
        yield dev


def unique_name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])

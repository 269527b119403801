"""What a tier is, declared: what it reads, what it writes, its delivery guarantee, and how it
builds its own part from its resources. :mod:`rollstream.tier.runtime` wires the rest.

A tier that reads a topic builds a :class:`~rollstream.kafka.consume_transform_produce.Transform`
(``EXACTLY_ONCE``: each input partition's output and offset in one Kafka transaction) or an
:class:`~rollstream.kafka.partition_loop.Intake` (``AT_LEAST_ONCE``: the consumer commits what
the intake says is done). A tier that reads nothing (the producer) is a source: it builds a
:class:`Source` and runs it. Topics are named by their role (``scored``, ``episodes``...); a
role of your own (``scored-filtered``) is a topic the runtime creates beside the trial's.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from rollstream.config import RollstreamConfig

Delivery = Literal["exactly-once", "at-least-once", "source"]
EXACTLY_ONCE: Delivery = "exactly-once"
AT_LEAST_ONCE: Delivery = "at-least-once"
SOURCE: Delivery = "source"


class Source(Protocol):
    """A tier that reads no topic: it runs until done or until ``stop`` is set."""

    async def run(self, stop: asyncio.Event) -> Any: ...


# gets the tier's rollstream.tier.context.TierContext; returns its Transform, Intake or Source
Build = Callable[[Any], Awaitable[Any]]


@dataclass(frozen=True)
class Reads:
    """How a tier reads its input topic (one role; a consumer group of the tier's own name)."""

    role: str
    poll_timeout_ms: int = 500  # one cycle waits at most this long for records
    max_records: int | None = None  # records per cycle at most (None: the consumer's default)
    session_timeout_ms: int = 10_000  # how soon a dead member's partitions move
    heartbeats_per_session: int = 3
    read_committed: bool = True
    consumer_options: Mapping[str, Any] = field(default_factory=dict)  # more AIOKafkaConsumer settings


@dataclass(frozen=True)
class Tier:
    """One tier, declared. ``instance`` names this process in logs and client ids."""

    name: str
    instance: str
    reads: Reads | None  # None: a source
    writes: tuple[str, ...]  # topic roles it produces to (the dead-letter topic is always there)
    delivery: Delivery
    build: Build
    max_consecutive_failures: int = 10  # exactly once: failed transactions in a row before it gives up
    commit_interval_seconds: float | None = 1.0  # at least once: how often done offsets are committed
    # after leaving its group on a graceful stop, the tier may finish work in flight this long
    # (its drains); the shutdown bound is shutdown_timeout_seconds plus this
    drain_seconds: float = 0.0

    def __post_init__(self) -> None:
        if (self.reads is None) != (self.delivery == SOURCE):
            raise ValueError(f"tier {self.name}: a source reads no topic; a tier that reads one is no source")

    @property
    def label(self) -> str:
        """``"reward-worker host-12"``: the tier and its instance, as logs name it."""
        return f"{self.name} {self.instance}"

    @property
    def client_id(self) -> str:
        return f"{self.name}-{self.instance}"

    def describe(self) -> str:
        """``"episodes -> scored, dead-letter (exactly once)"``."""
        source = self.reads.role if self.reads else "(no topic)"
        return f"{source} -> {', '.join(self.writes) or '-'} ({self.delivery.replace('-', ' ')})"


Declare = Callable[["RollstreamConfig"], Tier]


def default_instance() -> str:
    """``<hostname>-<pid>``: an instance name unique among running processes."""
    return f"{socket.gethostname()}-{os.getpid()}"

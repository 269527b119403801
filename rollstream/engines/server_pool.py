"""The servers one engine generates on: which are up, which are current, where a call goes.

Callers may rely on:

* :meth:`ServerPool.pick` returns a server that is up (not in its down cooldown) and current
  (it reported at least ``trainer_version - max_version_lag``), the one a request already used
  while it qualifies (bounded LRU), else the one with the fewest calls in flight. While every up
  server is behind it waits, re-reading their versions at most once per
  ``version_poll_seconds`` however many calls wait, and raises ``EngineUnavailableError`` after
  ``catch_up_timeout_seconds``. With no server up it waits for one to answer a probe again
  (probing at most once per ``version_poll_seconds``; a server restarting takes a minute) and
  raises ``EngineUnavailableError`` after ``down_patience_seconds`` (0: at once).
* :meth:`record_failure` counts failures in a row; ``failure_threshold`` of them mark a server
  down for ``down_cooldown_seconds``. A success resets the count.
* A server's version is what its label says (:meth:`Server.observe`), unless the label was
  written by an older fencing epoch than one this engine saw on that server: then it is taken
  for no version (not current) until the server's sync owner labels it again.
* :func:`stale_labels`: an answer's labels include one a former sync owner wrote after its
  successor (an epoch older than one the server had accepted before the request was sent, or
  than an earlier label of the same answer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from rollstream.config import ServerConfig
from rollstream.engines.server_admin import ServerAdmin, ServerHealth
from rollstream.engines.server_http import TRANSPORT_ERRORS, EngineUnavailableError, WeightLabel

logger = logging.getLogger(__name__)

MAX_STICKY = 100_000


@dataclass(eq=False)
class Server:
    url: str
    inflight: int = 0
    failures: int = 0  # consecutive
    down_until: float = 0.0
    version: int | None = None  # the weight version it last reported; None: not known yet
    epoch: int = 0  # the newest fencing epoch seen in its labels

    def observe(self, label: WeightLabel | None) -> None:
        """Take the server's label as its version (None when unread, loading, or written by an
        older epoch than one already seen on this server)."""
        if label is None:
            self.version = None
            return
        self.version = None if 0 < label.epoch < self.epoch else label.version
        self.epoch = max(self.epoch, label.epoch)

    def up(self, now: float) -> bool:
        return self.down_until <= now

    def current(self, minimum: int) -> bool:
        return self.version is not None and self.version >= minimum


def stale_labels(epochs: list[int], known: int) -> bool:
    """``epochs``: the fencing epochs of an answer's labels in the order its tokens were made (0:
    none, as the launch weights'); ``known``: the newest epoch seen on the server before the
    request was sent. A label can only have been written after the request started, so one
    older than ``known``, or than an earlier label of the answer, was written by a former sync owner."""
    newest = known
    for epoch in epochs:
        if 0 < epoch < newest:
            return True
        newest = max(newest, epoch)
    return False


@dataclass
class ServerEngineStats:
    """Counters for monitoring and tests (never reset by the engine)."""

    http_attempts: int = 0
    http_failures: int = 0
    resubmissions: int = 0
    servers_marked_down: int = 0
    duplicate_rids: int = 0  # 400 "Duplicate request ID" answers, retried with a new rid
    stale_spans: int = 0  # spans discarded: the server answered older than required
    unlabelled_spans: int = 0  # answers discarded: tokens labelled as made during a weight load
    stale_epoch_spans: int = 0  # answers discarded: tokens labelled by a former sync owner
    update_cuts: int = 0  # requests a weight update cut before their first token (not failures)
    catch_up_waits: int = 0  # calls that waited for a server to reach the trainer's version
    calls_per_server: Counter[str] = field(default_factory=Counter)  # generate posts by URL


class ServerPool:
    """The servers of one engine; see the module docstring."""

    def __init__(self, urls: list[str], settings: ServerConfig, admin: ServerAdmin, stats: ServerEngineStats) -> None:
        self.servers = [Server(url.rstrip("/")) for url in urls]
        self.settings = settings
        self.trainer_version = 0
        self._admin = admin
        self._stats = stats
        self._sticky: OrderedDict[str, Server] = OrderedDict()
        self._rotation = 0
        self._poll_lock = asyncio.Lock()
        self._next_poll = 0.0
        self._next_probe = 0.0

    def up_servers(self) -> list[Server]:
        now = time.monotonic()
        return [s for s in self.servers if s.up(now)]

    def server_for(self, rid: str) -> str | None:
        server = self._sticky.get(rid)
        return server.url if server else None

    async def pick(self, rid: str, last_error: BaseException | None) -> tuple[Server, int]:
        """A server that is up and current, and the minimum version it had to report."""
        deadline: float | None = None
        outage_ends: float | None = None
        while True:
            now = time.monotonic()
            minimum = self.trainer_version - self.settings.max_version_lag
            up = [s for s in self.servers if s.up(now)]
            if not up:
                outage_ends = outage_ends or now + self.settings.down_patience_seconds
                if now >= outage_ends:
                    raise EngineUnavailableError(
                        f"no {self._admin.kind} server available within {self.settings.down_patience_seconds}s "
                        f"{self.states(minimum)}; last error: {last_error!r}")
                await self._probe_down(outage_ends)
                continue
            outage_ends = None
            current = [s for s in up if s.current(minimum)]
            if current:
                return self._choose(rid, current), minimum
            if deadline is None:
                deadline = now + self.settings.catch_up_timeout_seconds
                self._stats.catch_up_waits += 1
            elif now >= deadline:
                raise EngineUnavailableError(
                    f"no {self._admin.kind} server reached weight version {minimum} within "
                    f"{self.settings.catch_up_timeout_seconds}s: {self.states(minimum)}")
            await self._refresh_versions(up, minimum)

    def _choose(self, rid: str, current: list[Server]) -> Server:
        server = self._sticky.get(rid)
        if server is None or server not in current:
            # Fewest in flight; the rotating tie-break spreads a burst of new requests.
            self._rotation += 1
            n = len(current)
            server = min(enumerate(current), key=lambda p: (p[1].inflight, (p[0] - self._rotation) % n))[1]
        self._sticky[rid] = server
        self._sticky.move_to_end(rid)
        while len(self._sticky) > MAX_STICKY:
            self._sticky.popitem(last=False)
        return server

    async def _refresh_versions(self, servers: list[Server], minimum: int) -> None:
        """Re-read the versions of servers that are behind (one poll per interval for all
        waiting calls), then sleep until the next poll may run."""
        async with self._poll_lock:
            if time.monotonic() >= self._next_poll:
                behind = [s for s in servers if not s.current(minimum)]
                await asyncio.gather(*(self._read_version(s) for s in behind))
                self._next_poll = time.monotonic() + self.settings.version_poll_seconds
        await asyncio.sleep(max(0.0, self._next_poll - time.monotonic()))

    async def _probe_down(self, until: float) -> None:
        """While every server is down: probe them (one probe per interval for all waiting
        calls); one that answers is up again at once, without waiting out its cooldown."""
        async with self._poll_lock:
            if time.monotonic() >= self._next_probe:
                probes = await asyncio.gather(*(self._admin.probe(s.url) for s in self.servers))
                for server, probe in zip(self.servers, probes):
                    if probe.health is not ServerHealth.DOWN:
                        logger.info("%s %s answers again (%s)", self._admin.kind, server.url, probe.health.value)
                        server.down_until, server.failures = 0.0, 0
                        server.observe(probe.label)
                self._next_probe = time.monotonic() + self.settings.version_poll_seconds
        await asyncio.sleep(max(0.0, min(self._next_probe, until) - time.monotonic()))

    async def _read_version(self, server: Server) -> None:
        try:
            server.observe(await self._admin.label(server.url))
        except TRANSPORT_ERRORS as exc:
            self.record_failure(server, exc)

    def states(self, minimum: int) -> dict[str, str]:
        """Each server's state in words, for error messages and logs."""
        now = time.monotonic()

        def state(s: Server) -> str:
            if not s.up(now):
                return f"down for {s.down_until - now:.0f}s more"
            if s.version is None:
                return "weight version unknown"
            return f"at v{s.version}" + ("" if s.current(minimum) else f", behind v{minimum}")

        return {s.url: state(s) for s in self.servers}

    def record_failure(self, server: Server, exc: BaseException) -> None:
        self._stats.http_failures += 1
        server.failures += 1
        logger.warning("%s %s failed (%d in a row): %r", self._admin.kind, server.url, server.failures, exc)
        if server.failures >= self.settings.failure_threshold and server.up(time.monotonic()):
            self.mark_down(server)

    def mark_down(self, server: Server) -> None:
        server.down_until = time.monotonic() + self.settings.down_cooldown_seconds
        self._stats.servers_marked_down += 1
        logger.error("%s %s marked down for %.0fs", self._admin.kind, server.url, self.settings.down_cooldown_seconds)

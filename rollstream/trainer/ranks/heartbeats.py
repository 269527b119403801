"""Heartbeats between the ranks of a trainer job: a dead or stalled rank is named in seconds.

A rank that dies in a collective leaves the others waiting in it, and a stopped rank
(SIGSTOP, a debugger, a swapped-out host) leaves them waiting until the collective timeout,
which must be long: a step, or rank 0's checkpoint, may take many minutes. So the ranks watch
each other apart from the collectives. Rank 0 listens on a TCP port (its address travels in
one broadcast when the watch starts); every other rank connects to it. Both ends send a small
heartbeat (:class:`Beat`: rank, pid, host, the step and phase the rank is in) every
``timeout / 4`` seconds (at most 1 s), and again at once whenever the rank enters a phase,
on a thread of their own, so a rank busy in a long step or blocked in a collective still
beats. A verdict (:class:`Verdict`) is reached when:

- **gone**: a peer's connection closed without a goodbye (its process ended; the kernel closes
  its sockets at once, so this is seen within milliseconds);
- **stalled**: no heartbeat for ``timeout`` seconds (stopped, hung in the kernel, host lost);
- **failed**: the peer said it failed (its loop raised), with its error;
- **ending**: rank 0 relays the verdict it reached about another rank before it ends, so every
  rank's log names the rank that caused it.

Rank 0 watches every rank, the others watch rank 0. On a verdict the watch calls its owner's
``on_lost`` (:class:`~rollstream.trainer.trainer_steps.TrainerSteps` logs one line and ends the
process, so that ``torchrun`` restarts the job). A rank that leaves its loop normally says
goodbye (``closed``) and is no longer watched.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import select
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

log = logging.getLogger(__name__)

# The exit status of a rank that ends because another rank was lost (EX_TEMPFAIL: try again):
# torchrun restarts the job on any non-zero status; this one tells "lost a peer" from a crash.
RANK_LOST_EXIT = 75

State = Literal["alive", "closed", "failed", "ending"]
Kind = Literal["gone", "stalled", "failed", "ending"]


class Beat(msgspec.Struct, frozen=True):
    """One heartbeat: who (rank, pid, host, process start time), where (step, phase), and
    whether the rank is still in its loop (``state``; ``detail``: why it failed or ends)."""

    rank: int
    pid: int
    host: str
    started: int  # the process's start time (Linux clock ticks since boot; 0 elsewhere)
    step: int
    phase: str
    state: State = "alive"
    detail: str = ""


_decoder = msgspec.json.Decoder(Beat)


@dataclass(frozen=True)
class Verdict:
    """Rank ``rank`` can no longer take part in the job: ``kind`` says how; ``step`` and
    ``phase`` are where its last heartbeat said it was; ``silent`` how long it has not beaten."""

    rank: int
    kind: Kind
    step: int
    phase: str
    silent: float
    timeout: float
    detail: str = ""
    beat: Beat | None = None

    def describe(self) -> str:
        who = f"rank {self.rank}" + (f" (pid {self.beat.pid} on {self.beat.host})" if self.beat else "")
        where = f"step {self.step}, phase '{self.phase}'"
        if self.kind == "gone":
            return f"{who} is gone: its connection closed without a goodbye (the process ended) in {where}"
        if self.kind == "stalled":
            if self.beat is None:
                return f"{who} never connected within {self.timeout:g} s (trainer.rank_timeout_seconds)"
            return (f"{who} stopped answering: no heartbeat for {self.silent:.1f} s "
                    f"(trainer.rank_timeout_seconds {self.timeout:g}) in {where}")
        if self.kind == "failed":
            return f"{who} failed in {where}: {self.detail}"
        return f"{who} ended the job in {where}: {self.detail}"


class Broadcaster(Protocol):
    """What the watch needs of :class:`~rollstream.trainer.ranks.Ranks`: who this rank is, and
    rank 0's value on every rank."""

    rank: int
    world_size: int

    def broadcast(self, value: Any) -> Any: ...


class _Peer:
    """One connection: the rank behind it (once it said hello), what it last said, when."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rank: int | None = None
        self.beat: Beat | None = None
        self.heard = time.monotonic()
        self.inbox = b""
        self.outbox = b""
        self.ended = False  # the connection closed


class RankWatch:
    """The heartbeats of one rank (see the module docstring); start it with :meth:`start`."""

    def __init__(self, rank: int, world: int, timeout: float, on_lost: Callable[[Verdict], None]) -> None:
        self.rank, self.world, self.timeout = rank, world, timeout
        self.interval = min(1.0, timeout / 4)
        self._on_lost = on_lost
        self._host = socket.gethostname()
        self._started = process_start_time(os.getpid())
        self._step, self._phase = 0, "start"
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._listener: socket.socket | None = None
        self._peers: list[_Peer] = []
        self._send_lock = threading.Lock()
        self._closing = threading.Event()
        self._decided = threading.Event()
        self.verdict: Verdict | None = None  # how a watched rank was lost (set once, by the watching thread)
        self._began = time.monotonic()
        self._rounds = 0  # the watching thread's checks so far
        self._round_done = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"rank-watch-{rank}", daemon=True)

    # -- lifecycle --

    @classmethod
    def start(cls, ranks: Broadcaster, timeout: float, on_lost: Callable[[Verdict], None]) -> RankWatch:
        """Start watching (collective: rank 0 broadcasts its address to the other ``ranks``)."""
        watch = cls(ranks.rank, ranks.world_size, timeout, on_lost)
        address = watch._listen() if watch.rank == 0 else None
        address = ranks.broadcast(address)
        if watch.rank != 0:
            watch._connect(tuple(address))
        watch._began = time.monotonic()
        watch._thread.start()
        atexit.register(watch.close)  # a loop that never closed its TrainerSteps still says goodbye
        return watch

    def close(self, state: State = "closed", detail: str = "") -> None:
        """Say goodbye (``closed``: left the loop normally; ``failed``: with ``detail``) and stop.
        Nothing is sent once a verdict was reached."""
        if self._closing.is_set():
            return
        self._closing.set()
        atexit.unregister(self.close)
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
        if self.verdict is None:
            self._broadcast(self._beat(state, detail), flush=True)
        for sock in [*(peer.sock for peer in self._peers), self._listener, self._wake_r, self._wake_w]:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self._selector.close()

    # -- what the owner tells and asks --

    def at(self, step: int, phase: str) -> None:
        """This rank is now in ``step``, ``phase``: the peers hear it at once."""
        self._step, self._phase = step, phase
        if not self._closing.is_set():
            self._broadcast(self._beat("alive"))

    @property
    def position(self) -> tuple[int, str]:
        return self._step, self._phase

    def settle(self, timeout: float | None = None) -> Verdict | None:
        """Wait up to ``timeout`` seconds (default: the rank timeout and one beat) for a verdict:
        after a collective failed, it tells a lost peer from another cause."""
        self._decided.wait(self.timeout + self.interval if timeout is None else timeout)
        return self.verdict

    def check_now(self, timeout: float) -> Verdict | None:
        """Have the watching thread read what its peers sent and check them once more (waiting
        up to ``timeout`` seconds): the verdict, if there is one. A peer that died has its
        connection closed already, so this names it without waiting for heartbeats."""
        with self._round_done:
            wanted = self._rounds + 2  # the round under way may have read its sockets already
            self._wake()
            self._round_done.wait_for(lambda: self._rounds >= wanted or self._decided.is_set()
                                      or not self._thread.is_alive(), timeout)
        return self.verdict

    # -- sockets --

    def _listen(self) -> tuple[str, int]:
        host = reachable_address()
        listener = socket.create_server((host, 0), backlog=max(8, self.world))
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._listener = listener
        return host, listener.getsockname()[1]

    def _connect(self, address: tuple[str, int]) -> None:
        try:
            sock = socket.create_connection(address, timeout=self.timeout)
        except OSError as exc:
            raise ConnectionError(
                f"rank {self.rank} cannot reach rank 0's heartbeat port at {address[0]}:{address[1]} ({exc}): rank 0 "
                "listens on the address that routes to MASTER_ADDR; every rank must reach it"
            ) from exc
        self._add(sock)
        self._broadcast(self._beat("alive"))  # hello: rank 0 learns which rank this is

    def _add(self, sock: socket.socket) -> _Peer:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = _Peer(sock)
        with self._send_lock:
            self._peers.append(peer)
        self._selector.register(sock, selectors.EVENT_READ, peer)
        return peer

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _beat(self, state: State, detail: str = "") -> bytes:
        beat = Beat(self.rank, os.getpid(), self._host, self._started, self._step, self._phase, state, detail)
        return msgspec.json.encode(beat) + b"\n"

    def _broadcast(self, data: bytes, flush: bool = False, skip: int | None = None) -> None:
        """Send ``data`` to every peer (but rank ``skip``); ``flush``: wait up to 1 s for a full buffer."""
        with self._send_lock:
            for peer in self._peers:
                if peer.ended or (skip is not None and peer.rank == skip):
                    continue
                peer.outbox += data
                self._flush(peer, wait=1.0 if flush else 0.0)

    def _flush(self, peer: _Peer, wait: float) -> None:
        """Send what ``peer`` has waiting; a full buffer keeps the rest for later (or waits up
        to ``wait`` seconds: the goodbye)."""
        deadline = time.monotonic() + wait
        while peer.outbox:
            try:
                sent = peer.sock.send(peer.outbox)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return
                select.select([], [peer.sock], [], max(0.0, deadline - time.monotonic()))
                continue
            except OSError:
                peer.ended = True
                return
            peer.outbox = peer.outbox[sent:]

    # -- the watching thread --

    def _run(self) -> None:
        next_beat = time.monotonic()
        try:
            while not self._closing.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    self._broadcast(self._beat("alive"))
                    next_beat = now + self.interval
                for key, _ in self._selector.select(max(0.0, next_beat - time.monotonic())):
                    self._readable(key)
                verdict = self._check(time.monotonic())
                if verdict is not None and not self._closing.is_set():
                    self._decide(verdict)
                    return
                with self._round_done:
                    self._rounds += 1
                    self._round_done.notify_all()
        except Exception:  # the job goes on without the watch; the collective timeout remains
            log.exception("rank %d: the heartbeat watch failed; dead or stalled ranks are now found only "
                          "by trainer.collective_timeout_seconds", self.rank)

    def _readable(self, key: selectors.SelectorKey) -> None:
        if key.fileobj is self._wake_r:
            with contextlib.suppress(OSError):
                self._wake_r.recv(4096)
        elif key.fileobj is self._listener:
            assert self._listener is not None
            with contextlib.suppress(BlockingIOError):
                sock, _ = self._listener.accept()
                self._add(sock)
        else:
            self._receive(key.data)

    def _receive(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            peer.ended = True
            self._selector.unregister(peer.sock)
            return
        peer.inbox += data
        *lines, peer.inbox = peer.inbox.split(b"\n")
        for line in lines:
            try:
                beat = _decoder.decode(line)
            except msgspec.DecodeError:
                log.warning("rank %d: ignoring an unreadable heartbeat %r", self.rank, line[:200])
                continue
            peer.rank, peer.beat, peer.heard = beat.rank, beat, time.monotonic()

    def _check(self, now: float) -> Verdict | None:
        """The first watched rank that can no longer take part, if any."""
        by_rank = {p.rank: p for p in self._peers if p.rank is not None}
        for rank in range(1, self.world) if self.rank == 0 else [0]:
            peer = by_rank.get(rank)
            if peer is None:
                if now - self._began > self.timeout:
                    return Verdict(rank, "stalled", 0, "start", now - self._began, self.timeout)
                continue
            beat = peer.beat
            assert beat is not None
            if beat.state == "closed":
                continue
            silent = now - peer.heard
            if beat.state in ("failed", "ending"):
                return Verdict(rank, beat.state, beat.step, beat.phase, silent, self.timeout, beat.detail, beat)
            if peer.ended:
                return Verdict(rank, "gone", beat.step, beat.phase, silent, self.timeout, beat=beat)
            if silent > self.timeout:
                return Verdict(rank, "stalled", beat.step, beat.phase, silent, self.timeout, beat=beat)
        return None

    def _decide(self, verdict: Verdict) -> None:
        self.verdict = verdict
        if self.rank == 0:  # every other rank learns who ended the job before rank 0 goes
            self._broadcast(self._beat("ending", verdict.describe()), flush=True, skip=verdict.rank)
        self._decided.set()
        with self._round_done:
            self._round_done.notify_all()
        self._on_lost(verdict)


def reachable_address() -> str:
    """The address of this host that the job's other hosts reach: the interface that routes to
    ``MASTER_ADDR`` (``torchrun``'s rendezvous host), else the host name's address."""
    master = os.environ.get("MASTER_ADDR")
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, int(os.environ.get("MASTER_PORT", "1") or 1)))  # no packet is sent
            return str(probe.getsockname()[0])
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


def process_start_time(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``); 0 when unknown.
    Tells a process from a later one that got the same pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return int(stat.rsplit(b")", 1)[1].split()[19])  # field 22, counted after the name
    except (OSError, IndexError, ValueError):
        return 0


def end_stalled_rank(verdict: Verdict) -> bool:
    """SIGKILL the stalled rank of ``verdict`` when it runs on this host (the same process it
    was: pid and start time), so that ``torchrun`` can restart the job now instead of waiting
    its grace period for a process that cannot answer SIGTERM. True when it was killed."""
    beat = verdict.beat
    if verdict.kind != "stalled" or beat is None or beat.host != socket.gethostname() or not beat.started:
        return False
    if process_start_time(beat.pid) != beat.started:
        return False
    try:
        os.kill(beat.pid, signal.SIGKILL)
    except OSError:
        return False
    return True

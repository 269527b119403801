"""The trainer's end of ``rollout.weight_transfer: distributed``: rank 0 sends each version's
tensors to every inference server's workers over a torch.distributed process group (the protocol:
:mod:`rollstream.engines.weight_transfer`).

Callers may rely on:

* :meth:`WeightSender.open` makes a version's tensors ready to send (nothing is copied yet) and
  lets servers join; :meth:`WeightSender.serve` then sends them to every server that joins,
  each over a process group of its own, until each of ``expected`` took the version (or failed), or
  ``trainer.weight_sender.timeout_seconds`` passed; then it closes the version (a server that
  asks later is told at once and catches up from a checkpoint) and reports who got it;
* the tensors must not change between :meth:`open` and the end of :meth:`serve` (the trainer
  waits in its publish);
* a server that dies, or stalls past the timeout, mid-transfer ends only its own transfer,
  named in the report; the others are served.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollstream.config import WeightSenderConfig
from rollstream.engines.weight_transfer import (
    OPEN_KEY,
    Manifest,
    TransferError,
    connect,
    new_session,
    pack,
    plan,
    process_group,
    ticket_key,
    verdict,
)

log = logging.getLogger(__name__)


@dataclass
class TransferReport:
    """How one version went out: who took it, who failed (and why), who never asked."""

    version: int
    bytes: int
    seconds: float = 0.0
    received: dict[str, float] = field(default_factory=dict)  # server -> seconds of its transfer
    failed: dict[str, str] = field(default_factory=dict)  # server -> why
    missed: list[str] = field(default_factory=list)  # expected, never joined

    def __str__(self) -> str:
        text = (f"v{self.version}: {self.bytes / 2**20:.1f} MiB to {len(self.received)} server(s) in "
                f"{self.seconds:.2f}s")
        if self.failed:
            text += f"; failed: {self.failed}"
        if self.missed:
            text += f"; never joined (they catch up from a checkpoint): {self.missed}"
        return text


@dataclass
class _Session:
    name: str
    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    tickets: int = 0  # servers that joined
    keys: list[str] = field(default_factory=list)  # what the servers wrote in the store


def named_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """A model's weights as its checkpoint names them (its ``state_dict``; a DDP wrapper's
    module), each storage once (a tied head shares the embedding's, as ``save_pretrained`` keeps it)."""
    first: dict[tuple[int, int], tuple[str, torch.Tensor]] = {}  # storage and offset -> the first name
    for name, tensor in getattr(model, "module", model).state_dict().items():
        first.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset()), (name, tensor.detach()))
    return list(first.values())


class WeightSender:
    """Rank 0's weight sender: hosts the rendezvous on ``settings.port`` and sends versions."""

    def __init__(self, settings: WeightSenderConfig) -> None:
        self.settings = settings
        self._store = connect(f"{settings.host}:{settings.port}", settings.timeout_seconds, master=True)
        self.address = f"{settings.host}:{self._store.port}"
        self._session: _Session | None = None
        log.info("weight sender listening on %s (%s)", self.address, settings.backend)

    def open(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Let servers join for ``version`` (see the module docstring)."""
        self._forget_previous()
        items = list(tensors)
        manifest = plan(version, items, self.settings.bucket_mb * 2**20)
        session = _Session(new_session(version), manifest, dict(items))
        self._store.set(f"{session.name}/manifest", manifest.encode())
        self._store.set(OPEN_KEY, json.dumps({"version": version, "session": session.name}))
        self._session = session

    def close(self) -> None:
        """Refuse joins for the open version (a server that asks is told to catch up)."""
        self._store.set(OPEN_KEY, "")

    def serve(self, expected: Iterable[str]) -> TransferReport:
        """Send the open version to every server that joins; see the module docstring."""
        session = self._session
        assert session is not None, "serve() after open()"
        waiting = {u.rstrip("/") for u in expected}
        report = TransferReport(session.manifest.version, session.manifest.nbytes)
        started = time.monotonic()
        deadline = started + self.settings.timeout_seconds
        threads: list[threading.Thread] = []
        try:
            while time.monotonic() < deadline and not waiting <= (set(report.received) | set(report.failed)):
                joined = int(self._store.add(f"{session.name}/tickets", 0))
                for ticket in range(session.tickets + 1, joined + 1):
                    request = json.loads(self._store.get(ticket_key(session.name, ticket)))
                    session.keys += [ticket_key(session.name, ticket), f"{session.name}/server/{request['server']}"]
                    thread = threading.Thread(target=self._send, args=(session, ticket, request, report),
                                              name=f"weights-to-{request['server']}", daemon=True)
                    thread.start()
                    threads.append(thread)
                session.tickets = joined
                time.sleep(0.005)
        finally:
            self.close()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()) + self.settings.timeout_seconds)
        report.seconds = time.monotonic() - started
        report.missed = sorted(waiting - set(report.received) - set(report.failed))
        return report

    def _send(self, session: _Session, ticket: int, request: dict[str, Any], report: TransferReport) -> None:
        server, workers = str(request["server"]), int(request["workers"])
        started = time.monotonic()
        timeout = self.settings.timeout_seconds
        device = self._device(session)
        try:
            pg = process_group(self._store, f"{session.name}/{ticket}", 0, 1 + workers, self.settings.backend, timeout)
            for bucket in range(len(session.manifest.bucket_sizes)):
                pg.broadcast(pack(session.manifest, bucket, session.tensors, device), 0).wait()
            loaded = verdict(pg, True, device) - 1
            if loaded != workers:
                raise TransferError(f"{workers - loaded} of its {workers} workers could not load v"
                                    f"{session.manifest.version} (the server's log says why)")
        except (RuntimeError, TransferError) as exc:
            report.failed[server] = f"{type(exc).__name__}: {exc}"[:500]
            log.error("sending v%d to %s failed (the server stays unused until a load succeeds): %s",
                      session.manifest.version, server, exc)
            return
        report.failed.pop(server, None)
        report.received[server] = time.monotonic() - started

    def _device(self, session: _Session) -> torch.device:
        if self.settings.backend == "gloo":
            return torch.device("cpu")
        first = next(iter(session.tensors.values()), None)
        return first.device if first is not None else torch.device("cuda")

    def _forget_previous(self) -> None:
        """The previous version's keys (its manifest, its tickets) are dropped from the store."""
        old, self._session = self._session, None
        if old is not None:
            for key in [f"{old.name}/manifest", f"{old.name}/tickets", *old.keys]:
                self._store.delete_key(key)

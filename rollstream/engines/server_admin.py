"""Control of ONE inference server: read its weight label, pause, load weights, continue, probe.

The contract every server kind (SGLang, vLLM) implements; the sync owner of a server
(``rollout_workers/weight_sync.py``) and the server pool (``server_pool.py``) use only this.
Only the sync owner of a server, or a process that owns every server it talks to
(``scripts/check_sglang.py``, ``ServerEngine.pause``), calls the mutating operations; rollout
workers that merely share a server never do.

Callers may rely on:

* every call is bounded: ``pause`` by ``pause_timeout_seconds``, ``load`` and ``receive`` by
  ``update_timeout_seconds``, the rest by ``health_probe_timeout_seconds`` (``rollout.server``);
* every mutating call carries the caller's fencing ``epoch`` (the sync owner's lease
  token). Where the server can check it (vLLM with rollstream's weight fence), a call from an
  epoch older than one it accepted is refused (:class:`~rollstream.engines.server_http.FencedOut`)
  and changes nothing; labels name the epoch that wrote them (``"<version>@<epoch>"``);
* ``pause`` in mode ``abort`` returns once the server answered every request it cut off (each
  answered as an abort with the tokens it had); in mode ``keep`` the running requests are
  frozen with their keys and values and go on at ``resume``; both hold new requests until
  ``resume``;
* after ``load`` (a checkpoint directory) or ``receive`` (the trainer sends the version over a
  torch.distributed process group) the server's weights are ``update``'s and every later answer labels
  its tokens ``update.version``, and no cached prefix computed with other weights is reused;
  a label never names weights the server does not hold: a failed load either restores the old
  weights with their label (SGLang) or leaves a label that is no rollstream version (vLLM,
  whose weights may be half loaded), so no worker uses the server until a load succeeds. A
  refused or partial load raises :class:`WeightLoadError` with the server's message;
* :meth:`ServerAdmin.probe` tells a server that generates from one that is up but does not
  generate (paused for a weight update, or loading) and from one that is down.
"""

from __future__ import annotations

import abc
import enum
import time
from dataclasses import dataclass

from typing import Literal

from rollstream.api.engine import WeightUpdate
from rollstream.engines.server_http import EngineRequestError, ServerHttp, WeightLabel

PauseMode = Literal["abort", "keep"]


def time_epoch() -> int:
    """A fencing epoch for a caller that owns every server it talks to (tests, scripts): the
    clock in ms, which is how lease tokens grow too (``rollstream.state.server_lease``)."""
    return int(time.time() * 1000)


class WeightLoadError(EngineRequestError):
    """The server refused to load a checkpoint (or answered that the load failed)."""


class NotServed(WeightLoadError):
    """The trainer no longer sends the version asked for: catch up from a checkpoint. Nothing
    was loaded."""


class TransferUnsupported(WeightLoadError):
    """The server kind cannot receive weights over a torch.distributed process group from rollstream's trainer."""


class ServerHealth(enum.Enum):
    GENERATING = "generating"  # up and not paused
    NOT_GENERATING = "not generating"  # up, but paused or loading
    DOWN = "down"  # it does not answer


@dataclass(frozen=True)
class Probe:
    """What one look at a server found; ``label`` is None when it was not read."""

    health: ServerHealth
    label: WeightLabel | None
    detail: str = ""


class ServerAdmin(abc.ABC):
    """Per-server control over a shared :class:`ServerHttp`; see the module docstring."""

    kind = "server"  # names the server kind in logs and errors

    def __init__(self, http: ServerHttp) -> None:
        self.http = http
        self.settings = http.settings

    @abc.abstractmethod
    async def label(self, url: str) -> WeightLabel:
        """The server's weight label (its version is None when it names none rollstream set).
        Transport errors propagate."""

    @abc.abstractmethod
    async def pause(self, url: str, epoch: int, mode: PauseMode = "abort") -> None:
        """Cut off (``abort``) or freeze (``keep``) the server's running requests and hold new
        ones until :meth:`resume`."""

    @abc.abstractmethod
    async def load(self, url: str, update: WeightUpdate, epoch: int, mode: PauseMode = "abort") -> None:
        """Load the checkpoint ``update.path`` (between :meth:`pause` and :meth:`resume` in
        ``mode``) and label it."""

    async def receive(self, url: str, update: WeightUpdate, epoch: int, mode: PauseMode = "abort") -> None:
        """Receive ``update`` from the trainer's weight sender (``update.source``) and label it."""
        raise TransferUnsupported(f"{self.kind} servers do not receive weights over a torch.distributed "
                                  "group from rollstream's trainer: use rollout.weight_transfer: checkpoint")

    @abc.abstractmethod
    async def resume(self, url: str, epoch: int) -> None:
        """Release held requests (harmless on a running server)."""

    @abc.abstractmethod
    async def probe(self, url: str) -> Probe:
        """Generating, up but not generating, or down (see :class:`ServerHealth`)."""

    async def updating(self, url: str, since: tuple[int | None, int]) -> bool:
        """Whether a weight update is under way or happened since the server's label was
        ``since`` (version, epoch): how a request cut before its first token tells a weight
        update from other aborts. Default: the label changed."""
        label = await self.label(url)
        return label.loading or (label.version, label.epoch) != since

    async def check_api(self, url: str, mode: PauseMode = "abort") -> None:
        """Raise :class:`EngineRequestError` saying how to start the server when it lacks an
        API rollstream needs for weight updates in ``mode`` (checked once per server at start).
        Default: nothing to check."""

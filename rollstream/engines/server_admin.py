"""Control of ONE inference server: read its weight version, pause, load weights, continue, probe.

The contract every server kind (SGLang, vLLM) implements; the weight-sync owner of a server
(``rollout_workers/weight_sync.py``) and the server pool (``server_pool.py``) use only this.
Only the weight-sync owner of a server, or a process that owns every server it talks to
(``scripts/check_sglang.py``, ``ServerEngine.pause``), calls the mutating operations; rollout
workers that merely share a server never do.

Callers may rely on:

* every call is bounded: ``pause`` by ``pause_timeout_seconds``, ``load`` by
  ``update_timeout_seconds``, the rest by ``health_probe_timeout_seconds`` (``rollout.server``);
* ``pause`` returns once the server answered every request it cut off (each answered as an
  abort with the tokens it had), and holds new requests until ``resume``;
* after ``load`` the server's weights are ``update``'s and every later answer labels its tokens
  ``update.version``; a label never names weights the server does not hold: a failed load
  either restores the old weights with their label (SGLang) or leaves a label that is no
  rollstream version (vLLM, whose weights may be half loaded), so no worker uses the server
  until a load succeeds. A refused load raises :class:`WeightLoadError` with the server's
  message;
* :meth:`ServerAdmin.probe` tells a server that generates from one that is up but does not
  generate (paused for a weight update, or loading) and from one that is down.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass

from rollstream.api.engine import WeightUpdate
from rollstream.engines.server_http import EngineRequestError, ServerHttp


class WeightLoadError(EngineRequestError):
    """The server refused to load a checkpoint (or answered that the load failed)."""


class ServerHealth(enum.Enum):
    GENERATING = "generating"  # up and not paused
    NOT_GENERATING = "not generating"  # up, but paused or loading
    DOWN = "down"  # it does not answer


@dataclass(frozen=True)
class Probe:
    """What one look at a server found; ``weight_version`` is None when it was not read."""

    health: ServerHealth
    weight_version: int | None
    detail: str = ""


class ServerAdmin(abc.ABC):
    """Per-server control over a shared :class:`ServerHttp`; see the module docstring."""

    kind = "server"  # names the server kind in logs and errors

    def __init__(self, http: ServerHttp) -> None:
        self.http = http
        self.settings = http.settings

    @abc.abstractmethod
    async def weight_version(self, url: str) -> int | None:
        """The version the server reports; None when it reports none rollstream set.
        Transport errors propagate."""

    @abc.abstractmethod
    async def pause(self, url: str) -> None:
        """Cut off the server's running requests and hold new ones until :meth:`resume`."""

    @abc.abstractmethod
    async def load(self, url: str, update: WeightUpdate) -> None:
        """Load ``update`` (between :meth:`pause` and :meth:`resume`) and label it."""

    @abc.abstractmethod
    async def resume(self, url: str) -> None:
        """Release held requests (harmless on a running server)."""

    @abc.abstractmethod
    async def probe(self, url: str) -> Probe:
        """Generating, up but not generating, or down (see :class:`ServerHealth`)."""

    async def check_api(self, url: str) -> None:
        """Raise :class:`EngineRequestError` saying how to start the server when it lacks an
        API rollstream needs (checked once per server at start). Default: nothing to check."""

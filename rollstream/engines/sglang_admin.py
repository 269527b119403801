"""Control of ONE SGLang server: read its weight version, pause, load weights, continue, probe.

Only the weight-sync owner of a server (``rollout_workers/weight_sync.py``) or a process that
owns every server it talks to (``scripts/check_sglang.py``, ``SGLangEngine.pause``) calls the
mutating operations; rollout workers that merely share a server never do.

Callers may rely on:

* every call is bounded: ``pause`` by ``pause_timeout_seconds`` (SGLang answers
  ``/pause_generation`` only after the requests it aborted were answered), ``load`` by
  ``update_timeout_seconds``, the rest by ``health_probe_timeout_seconds``;
* ``load`` sends ``weight_version`` = the rollstream version as a decimal string, so every
  later ``/generate`` answer reports which weights produced its tokens; a refused load raises
  :class:`WeightLoadError` with SGLang's message;
* :meth:`SGLangAdmin.probe` tells a server that generates from one that is up but does not
  generate (paused for a weight update, or loading) and from one that is down.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from rollstream.api.engine import WeightUpdate
from rollstream.engines.sglang_http import (
    TRANSPORT_ERRORS,
    EngineRequestError,
    HttpRefused,
    SGLangHttp,
    parse_weight_version,
)

log = logging.getLogger(__name__)


class WeightLoadError(EngineRequestError):
    """``/update_weights_from_disk`` answered ``success: false`` (or was refused)."""


class ServerHealth(enum.Enum):
    GENERATING = "generating"  # /health answered 200: it generates a token
    NOT_GENERATING = "not generating"  # up (/model_info answers) but /health did not: paused or loading
    DOWN = "down"  # neither answered


@dataclass(frozen=True)
class Probe:
    """What one look at a server found; ``weight_version`` is None when it was not read."""

    health: ServerHealth
    weight_version: int | None
    detail: str = ""


class SGLangAdmin:
    """Per-server control over a shared :class:`SGLangHttp`; see the module docstring."""

    def __init__(self, http: SGLangHttp) -> None:
        self.http = http
        self.settings = http.settings

    async def weight_version(self, url: str) -> int | None:
        """The version the server reports (``/model_info``; ``/get_weight_version`` on older
        servers). None when it reports none that rollstream wrote. Transport errors propagate."""
        timeout = self.settings.health_probe_timeout_seconds
        for path in ("/model_info", "/get_weight_version"):
            status, body = await self.http.get(url, path, timeout)
            if status == 200 and isinstance(body, dict) and "weight_version" in body:
                return parse_weight_version(body["weight_version"])
        return None

    async def pause(self, url: str) -> None:
        """Abort the server's running requests and hold new ones at its gate."""
        await self.http.post(url, "/pause_generation", {"mode": "abort"}, self.settings.pause_timeout_seconds)

    async def load(self, url: str, update: WeightUpdate) -> None:
        """Load ``update`` and tag the server with its version; WeightLoadError when refused."""
        body = {"model_path": update.path, "weight_version": str(update.version)}
        try:
            answer = await self.http.post(url, "/update_weights_from_disk", body, self.settings.update_timeout_seconds)
        except HttpRefused as exc:  # SGLang answers a failed load with 400 {"success": false}
            raise WeightLoadError(f"loading version {update.version} on {url} failed: {exc.message}") from exc
        if not (isinstance(answer, dict) and answer.get("success")):
            raise WeightLoadError(f"loading version {update.version} on {url} failed: {answer!r}"[:400])

    async def resume(self, url: str) -> None:
        """``/continue_generation``: release held requests (harmless on a running server)."""
        await self.http.post(url, "/continue_generation", {}, self.settings.health_probe_timeout_seconds)

    async def probe(self, url: str) -> Probe:
        """Generating, up but not generating, or down (see :class:`ServerHealth`)."""
        timeout = self.settings.health_probe_timeout_seconds
        detail = ""
        try:
            status, _ = await self.http.get(url, "/health", timeout)
            if status == 200:
                return Probe(ServerHealth.GENERATING, await self._version_or_none(url))
            detail = f"/health answered {status}"
        except TRANSPORT_ERRORS as exc:
            # SGLang's /health generates a token: while paused it hangs (503 after ~20 s).
            detail = f"/health: {type(exc).__name__}"
        try:
            version = await self.weight_version(url)
        except TRANSPORT_ERRORS as exc:
            return Probe(ServerHealth.DOWN, None, f"{detail}; /model_info: {type(exc).__name__}: {exc}")
        return Probe(ServerHealth.NOT_GENERATING, version, detail)

    async def _version_or_none(self, url: str) -> int | None:
        try:
            return await self.weight_version(url)
        except TRANSPORT_ERRORS:
            return None

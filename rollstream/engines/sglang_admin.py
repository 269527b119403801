"""Control of ONE SGLang server (:class:`~rollstream.engines.server_admin.ServerAdmin`).

SGLang specifics the contract rests on:

* ``/pause_generation`` mode ``abort`` answers only after the requests it aborted were
  answered; mode ``in_place`` (rollstream's ``keep``) freezes the running requests with their
  keys and values until ``/continue_generation``;
* ``load`` sends ``weight_version`` = ``"<version>@<epoch>"`` with the weights in the same call,
  so every later ``/generate`` answer reports which weights produced its tokens and which sync owner
  loaded them; SGLang restores the old weights when a load fails, and keeps the old label. The
  label and the weights change in one call, so a former sync owner's late call can at worst load
  (and truthfully label) older weights, which its successor's reconcile replaces: SGLang has no
  place for rollstream's weight fence;
* ``flush_cache: true`` with each load drops the prefix (radix) cache;
* ``/health`` generates a token: while paused it hangs (503 after ~20 s), so a server that does
  not answer it but answers ``/model_info`` is up and not generating.
"""

from __future__ import annotations

from rollstream.api.engine import WeightUpdate
from rollstream.engines.server_admin import PauseMode, Probe, ServerAdmin, ServerHealth, WeightLoadError
from rollstream.engines.server_http import TRANSPORT_ERRORS, HttpRefused, WeightLabel, parse_label, weight_label

PAUSE_MODES = {"abort": "abort", "keep": "in_place"}


class SGLangAdmin(ServerAdmin):
    """Per-server control of SGLang servers; see the module docstring."""

    kind = "SGLang"

    async def label(self, url: str) -> WeightLabel:
        """``/model_info``'s ``weight_version`` (``/get_weight_version`` on older servers)."""
        timeout = self.settings.health_probe_timeout_seconds
        for path in ("/model_info", "/get_weight_version"):
            status, body = await self.http.get(url, path, timeout)
            if status == 200 and isinstance(body, dict) and "weight_version" in body:
                return parse_label(body["weight_version"])
        return WeightLabel(None)

    async def pause(self, url: str, epoch: int, mode: PauseMode = "abort") -> None:
        await self.http.post(url, "/pause_generation", {"mode": PAUSE_MODES[mode]}, self.settings.pause_timeout_seconds)

    async def load(self, url: str, update: WeightUpdate, epoch: int, mode: PauseMode = "abort") -> None:
        body = {"model_path": update.path, "weight_version": weight_label(update.version, epoch), "flush_cache": True}
        try:
            answer = await self.http.post(url, "/update_weights_from_disk", body, self.settings.update_timeout_seconds)
        except HttpRefused as exc:  # SGLang answers a failed load with 400 {"success": false}
            raise WeightLoadError(f"loading version {update.version} on {url} failed: {exc.message}") from exc
        if not (isinstance(answer, dict) and answer.get("success")):
            raise WeightLoadError(f"loading version {update.version} on {url} failed: {answer!r}"[:400])

    async def resume(self, url: str, epoch: int) -> None:
        await self.http.post(url, "/continue_generation", {}, self.settings.health_probe_timeout_seconds)

    async def probe(self, url: str) -> Probe:
        timeout = self.settings.health_probe_timeout_seconds
        detail = ""
        try:
            status, _ = await self.http.get(url, "/health", timeout)
            if status == 200:
                try:
                    return Probe(ServerHealth.GENERATING, await self.label(url))
                except TRANSPORT_ERRORS:
                    return Probe(ServerHealth.GENERATING, None)
            detail = f"/health answered {status}"
        except TRANSPORT_ERRORS as exc:
            detail = f"/health: {type(exc).__name__}"
        try:
            label = await self.label(url)
        except TRANSPORT_ERRORS as exc:
            return Probe(ServerHealth.DOWN, None, f"{detail}; /model_info: {type(exc).__name__}: {exc}")
        return Probe(ServerHealth.NOT_GENERATING, label, detail)

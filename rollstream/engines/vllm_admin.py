"""Control of ONE vLLM server (:class:`~rollstream.engines.server_admin.ServerAdmin`).

The server must run vLLM >= 0.32 with ``VLLM_SERVER_DEV_MODE=1`` (the RL routes: ``/pause``,
``/resume``, ``/is_paused``, ``/collective_rpc``, ``/update_weight_version``, ``/weight_info``,
``/reset_prefix_cache``), ``--enable-scale-out`` (the token-in/token-out
``/inference/v1/generate``), ``--worker-extension-cls`` :data:`EXTENSION` and ``--middleware``
:data:`FENCE` (``rollstream.dev.vllm_server`` starts it so; :meth:`VLLMAdmin.check_api` says
what is missing).

vLLM specifics the contract rests on (vLLM 0.32's code and a real server on CPU):

* every mutating call carries the sync owner's epoch in the weight fence's header, and the fence
  refuses an older one (``vllm_weight_fence.py``), so a former sync owner changes nothing;
* ``POST /pause?mode=abort`` aborts every running request (each answered with finish reason
  ``abort`` and the tokens it had), clears the prefix and multimodal caches, and holds requests
  that arrive while paused until ``/resume``; ``mode=keep&clear_cache=false`` freezes the
  running requests with their keys and values instead (they go on at ``/resume``);
* the engine core stamps every decode pass's output with its current weight-version label, and the
  token-in/token-out answer returns them as ``weight_versions`` spans; the label changes only
  through ``/update_weight_version``;
* a load labels the server ``loading:<version>@<epoch>`` (no rollstream version), loads through
  the worker extension (all or nothing, ``vllm_worker_extension.py``), clears the prefix cache,
  then labels it ``<version>@<epoch>``: a failed or interrupted load leaves a label no worker
  trusts, whatever weights it left behind;
* a server in ``keep`` mode must not cache prefixes across requests (``--no-enable-prefix-caching``):
  vLLM clears the prefix cache only when no request holds a block, and frozen requests hold
  theirs, so a new request could otherwise reuse keys and values of the old weights;
* ``/health`` answers while paused; ``/is_paused`` tells the two apart.
"""

from __future__ import annotations

import json
import time
from typing import Any

from rollstream.api.engine import WeightUpdate
from rollstream.engines.server_admin import NotServed, PauseMode, Probe, ServerAdmin, ServerHealth, WeightLoadError
from rollstream.engines.server_http import (
    TRANSPORT_ERRORS,
    EngineRequestError,
    FencedOut,
    HttpRefused,
    Retryable,
    WeightLabel,
    loading_label,
    parse_label,
    weight_label,
)
from rollstream.engines.vllm_weight_fence import FENCE_HEADER, FENCE_PATH

LOAD_METHOD = "rollstream_load_weights"  # rollstream.engines.vllm_worker_extension.WeightLoader
RECEIVE_METHOD = "rollstream_receive_weights"
EXTENSION = "rollstream.engines.vllm_worker_extension.WeightLoader"
FENCE = "rollstream.engines.vllm_weight_fence.WeightFence"


class VLLMAdmin(ServerAdmin):
    """Per-server control of vLLM servers; see the module docstring."""

    kind = "vLLM"

    async def label(self, url: str) -> WeightLabel:
        status, body = await self.http.get(url, "/weight_info", self.settings.health_probe_timeout_seconds)
        if status == 200 and isinstance(body, dict):
            return parse_label(body.get("weight_version"))
        return WeightLabel(None)

    async def pause(self, url: str, epoch: int, mode: PauseMode = "abort") -> None:
        query = "mode=abort" if mode == "abort" else "mode=keep&clear_cache=false"
        await self._post(url, f"/pause?{query}", {}, epoch, self.settings.pause_timeout_seconds)

    async def load(self, url: str, update: WeightUpdate, epoch: int, mode: PauseMode = "abort") -> None:
        body = {"method": LOAD_METHOD, "args": [update.path, str(epoch)]}
        await self._load(url, update.version, epoch, mode, body, f"from {update.path}")

    async def receive(self, url: str, update: WeightUpdate, epoch: int, mode: PauseMode = "abort") -> None:
        # Waits end with the trainer's window (a trainer that died leaves nothing to wait for).
        timeout = min(self.settings.update_timeout_seconds, max(10.0, update.open_until - time.time() + 10.0))
        request = {"address": update.source, "version": update.version, "server": url, "backend": update.backend,
                   "timeout": timeout, "epoch": epoch}
        body = {"method": RECEIVE_METHOD, "args": [json.dumps(request)]}
        await self._load(url, update.version, epoch, mode, body, f"from the trainer at {update.source}")

    async def _load(self, url: str, version: int, epoch: int, mode: PauseMode, body: dict[str, Any],
                    source: str) -> None:
        """Label loading, load through the extension, clear the prefix cache, label the version.

        The prefix cache: in ``abort`` mode every cached block goes, and a request that holds
        blocks (none, once paused) is recomputed from its tokens with the new weights; in
        ``keep`` mode the frozen requests keep theirs, and the server caches no prefixes.
        """
        await self._label(url, loading_label(version, epoch), epoch)
        try:
            answer = await self._post(url, "/collective_rpc", body, epoch, self.settings.update_timeout_seconds)
        except FencedOut:
            raise
        except (HttpRefused, Retryable) as exc:
            raise WeightLoadError(f"loading version {version} {source} on {url} failed: {exc} (its label stays "
                                  f"{loading_label(version, epoch)!r}: no worker uses it until a load succeeds)") from exc
        refused = [r for r in (answer or {}).get("results", []) if isinstance(r, dict) and r.get("served") is False]
        if refused:
            raise NotServed(f"version {version} {source} on {url}: {refused[0].get('reason')}")
        reset = "/reset_prefix_cache" + ("?reset_running_requests=true" if mode == "abort" else "")
        await self._post(url, reset, {}, epoch, self.settings.health_probe_timeout_seconds)
        await self._label(url, weight_label(version, epoch), epoch)

    async def _label(self, url: str, label: str, epoch: int) -> None:
        await self._post(url, "/update_weight_version", {"new_version": label}, epoch,
                         self.settings.health_probe_timeout_seconds)

    async def resume(self, url: str, epoch: int) -> None:
        await self._post(url, "/resume", {}, epoch, self.settings.health_probe_timeout_seconds)

    async def _post(self, url: str, path: str, body: dict[str, Any], epoch: int, timeout: float) -> Any:
        return await self.http.post(url, path, body, timeout, headers={FENCE_HEADER: str(epoch)})

    async def probe(self, url: str) -> Probe:
        timeout = self.settings.health_probe_timeout_seconds
        try:
            status, _ = await self.http.get(url, "/health", timeout)
            if status != 200:
                return Probe(ServerHealth.DOWN, None, f"/health answered {status}")
            _, paused = await self.http.get(url, "/is_paused", timeout)
            label = await self.label(url)
        except TRANSPORT_ERRORS as exc:
            return Probe(ServerHealth.DOWN, None, f"{type(exc).__name__}: {exc}")
        if isinstance(paused, dict) and paused.get("is_paused"):
            return Probe(ServerHealth.NOT_GENERATING, label, "/is_paused: true")
        return Probe(ServerHealth.GENERATING, label)

    async def updating(self, url: str, since: tuple[int | None, int]) -> bool:
        """Paused, or labelled otherwise than ``since``: a sync owner pauses before it labels and
        labels before it continues, so a request its pause cut sees one or the other."""
        _, paused = await self.http.get(url, "/is_paused", self.settings.health_probe_timeout_seconds)
        return bool(isinstance(paused, dict) and paused.get("is_paused")) or await super().updating(url, since)

    async def check_api(self, url: str, mode: PauseMode = "abort") -> None:
        """The RL routes (dev mode), the token-in/token-out route, the weight fence and the
        worker extension must be there; a ``keep`` server must not cache prefixes."""
        timeout = self.settings.health_probe_timeout_seconds
        status, _ = await self.http.get(url, "/weight_info", timeout)
        if status == 404:
            raise EngineRequestError(
                f"vLLM at {url} has no /weight_info: start it with VLLM_SERVER_DEV_MODE=1 (the routes that "
                "pause it, load weights and label them)")
        try:
            await self.http.post(url, "/inference/v1/generate", {}, timeout)
        except HttpRefused as exc:
            if exc.status in (403, 404):
                raise EngineRequestError(
                    f"vLLM at {url} does not serve /inference/v1/generate ({exc.message}): start it with "
                    "--enable-scale-out (vLLM >= 0.32: token ids in and out, with each token's weight version)"
                ) from None
        status, fence = await self.http.get(url, FENCE_PATH, timeout)
        if status != 200 or not isinstance(fence, dict):
            raise EngineRequestError(
                f"vLLM at {url} has no weight fence ({FENCE_PATH} answered {status}): start it with "
                f"--middleware {FENCE} (install rollstream with --no-deps beside vLLM)")
        if not fence.get("extension"):
            raise EngineRequestError(
                f"vLLM at {url} cannot load weights for rollstream ({fence.get('extension_error')}): start it "
                f"with --worker-extension-cls {EXTENSION} (install rollstream with --no-deps beside vLLM)")
        if mode == "keep" and fence.get("prefix_caching"):
            raise EngineRequestError(
                f"vLLM at {url} caches prefixes, which rollout.weight_update_mode 'keep' cannot clear while "
                "requests are frozen with their keys and values: start it with --no-enable-prefix-caching, "
                "or use rollout.weight_update_mode: abort")

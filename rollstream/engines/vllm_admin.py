"""Control of ONE vLLM server (:class:`~rollstream.engines.server_admin.ServerAdmin`).

The server must run vLLM >= 0.32 with ``VLLM_SERVER_DEV_MODE=1`` (the RL routes: ``/pause``,
``/resume``, ``/is_paused``, ``/collective_rpc``, ``/update_weight_version``, ``/weight_info``),
``--enable-scale-out`` (the token-in/token-out ``/inference/v1/generate``) and
``--worker-extension-cls rollstream.engines.vllm_worker_extension.WeightLoader``
(``rollstream.dev.vllm_server`` starts it so; :meth:`VLLMAdmin.check_api` says what is missing).

vLLM specifics the contract rests on (vLLM 0.32's code and a real server on CPU):

* ``POST /pause?mode=abort`` aborts every running request (each answered with finish reason
  ``abort`` and the tokens it had), clears the prefix and multimodal caches, and holds requests
  that arrive while paused until ``/resume``: nothing is computed with weights a later label
  does not name;
* the engine core stamps every step's output with its current weight-version label, and the
  token-in/token-out answer returns them as ``weight_versions`` spans; the label changes only
  through ``/update_weight_version``, which :meth:`VLLMAdmin.load` calls while paused;
* ``load`` labels the server ``loading:<version>`` (no rollstream version), loads the checkpoint
  through the worker extension, then labels it ``<version>``: a failed or interrupted load
  leaves a label no worker trusts, whatever weights it left behind;
* ``/health`` answers while paused; ``/is_paused`` tells the two apart.
"""

from __future__ import annotations

from rollstream.api.engine import WeightUpdate
from rollstream.engines.server_admin import Probe, ServerAdmin, ServerHealth, WeightLoadError
from rollstream.engines.server_http import (
    TRANSPORT_ERRORS,
    EngineRequestError,
    HttpRefused,
    Retryable,
    parse_weight_version,
)

LOAD_METHOD = "rollstream_load_weights"  # rollstream.engines.vllm_worker_extension.WeightLoader
PING_METHOD = "rollstream_ping"
LOADING_PREFIX = "loading:"
EXTENSION = "rollstream.engines.vllm_worker_extension.WeightLoader"


def loading_label(version: int) -> str:
    """The label of a server while it loads ``version``: deliberately no rollstream version."""
    return f"{LOADING_PREFIX}{version}"


class VLLMAdmin(ServerAdmin):
    """Per-server control of vLLM servers; see the module docstring."""

    kind = "vLLM"

    async def weight_version(self, url: str) -> int | None:
        status, body = await self.http.get(url, "/weight_info", self.settings.health_probe_timeout_seconds)
        if status == 200 and isinstance(body, dict):
            return parse_weight_version(body.get("weight_version"))
        return None

    async def pause(self, url: str) -> None:
        await self.http.post(url, "/pause?mode=abort", {}, self.settings.pause_timeout_seconds)

    async def load(self, url: str, update: WeightUpdate) -> None:
        await self._label(url, loading_label(update.version))
        body = {"method": LOAD_METHOD, "args": [update.path]}
        try:
            await self.http.post(url, "/collective_rpc", body, self.settings.update_timeout_seconds)
        except (HttpRefused, Retryable) as exc:
            raise WeightLoadError(
                f"loading version {update.version} from {update.path} on {url} failed: {exc} (the server "
                f"must run with --worker-extension-cls {EXTENSION}, and the directory must be readable there)"
            ) from exc
        await self._label(url, str(update.version))

    async def _label(self, url: str, label: str) -> None:
        await self.http.post(url, "/update_weight_version", {"new_version": label},
                             self.settings.health_probe_timeout_seconds)

    async def resume(self, url: str) -> None:
        await self.http.post(url, "/resume", {}, self.settings.health_probe_timeout_seconds)

    async def probe(self, url: str) -> Probe:
        timeout = self.settings.health_probe_timeout_seconds
        try:
            status, _ = await self.http.get(url, "/health", timeout)
            if status != 200:
                return Probe(ServerHealth.DOWN, None, f"/health answered {status}")
            _, paused = await self.http.get(url, "/is_paused", timeout)
            version = await self.weight_version(url)
        except TRANSPORT_ERRORS as exc:
            return Probe(ServerHealth.DOWN, None, f"{type(exc).__name__}: {exc}")
        if isinstance(paused, dict) and paused.get("is_paused"):
            return Probe(ServerHealth.NOT_GENERATING, version, "/is_paused: true")
        return Probe(ServerHealth.GENERATING, version)

    async def check_api(self, url: str) -> None:
        """The RL routes (dev mode) and the token-in/token-out route must be there."""
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
        try:
            await self.http.post(url, "/collective_rpc", {"method": PING_METHOD}, timeout)
        except (HttpRefused, Retryable) as exc:
            raise EngineRequestError(
                f"vLLM at {url} cannot load checkpoints for rollstream ({exc}): start it with "
                f"--worker-extension-cls {EXTENSION} (install rollstream with --no-deps beside vLLM)"
            ) from None

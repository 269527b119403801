"""A local vLLM server (CPU or GPU) for tests, the demo and `rollstream dev up --vllm`.

vLLM runs in an environment of its own (it pins torch and transformers versions that differ
from ours): ``ROLLSTREAM_VLLM_PYTHON`` names its interpreter, else the one
``scripts/setup.sh`` installs (``~/.cache/rollstream/vllm-venv``). The server is started the
way rollstream needs it (:func:`server_argv`, :data:`SERVER_ENV`; each flag's reason:
docs/DEPLOYMENT.md), with rollstream's server-side modules alone on its ``PYTHONPATH``
(:data:`SERVER_SIDE_MODULES`), so it needs nothing else of rollstream.

The server and its engine processes run in a process group of their own: ``stop`` and ``kill``
reach all of them. ``restart`` brings it back on the same port with its launch weights (version
0), as a crashed server comes back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rollstream.config import ServerLaunchConfig
from rollstream.engines.server_launch import resolved_device, vllm_flags
from rollstream.dev.processes import (
    LOCALHOST, LocalServer, MissingToolError, pid_alive, pid_cmdline, stop_pid)

logger = logging.getLogger(__name__)

VENV = Path.home() / ".cache" / "rollstream" / "vllm-venv"
EXTENSION = "rollstream.engines.vllm_worker_extension.WeightLoader"
FENCE = "rollstream.engines.vllm_weight_fence.WeightFence"
# What runs inside the vLLM server: these import nothing else of rollstream.
SERVER_SIDE_MODULES = ("vllm_worker_extension", "vllm_weight_fence", "weight_transfer")
# What every rollstream vLLM server runs with (compose.yaml's vllm service too).
SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /update_weight_version, /weight_info
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU (ignored on GPUs)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # share the cores with the other processes on CPU
    "HF_HUB_OFFLINE": "1",  # the model is a local directory
}


class VLLMStartError(RuntimeError):
    """The vLLM server did not become healthy; the message ends with the last lines of its log."""


def vllm_python() -> str:
    """The interpreter of vLLM's environment; MissingToolError saying how to install it."""
    configured = os.environ.get("ROLLSTREAM_VLLM_PYTHON")
    candidate = configured or str(VENV / "bin" / "python")
    if shutil.which(candidate) is None:
        raise MissingToolError(
            f"no vLLM environment at {candidate}: run `bash scripts/setup.sh` (it installs vLLM into "
            f"{VENV}), or set ROLLSTREAM_VLLM_PYTHON to the python of an environment with vllm installed")
    return candidate


def server_argv(python: str, model: str, port: int, launch: ServerLaunchConfig, *, host: str = LOCALHOST,
                served_name: str = "") -> list[str]:
    """The command line of a rollstream vLLM server (see the module docstring): ``launch``'s
    settings (``rollout.launch``) and what rollstream needs."""
    return [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--served-model-name", served_name or Path(model).name,
        *vllm_flags(launch, resolved_device(launch)),
        "--host", host,
        "--port", str(port),
        "--enable-scale-out",  # /inference/v1/generate: token ids in and out, with weight versions
        "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", EXTENSION,
        "--middleware", FENCE,
    ]


def extension_path(workdir: Path) -> Path:
    """A directory to put on the server's PYTHONPATH that holds rollstream's server-side modules
    and nothing else of rollstream (the server's environment has its own torch and transformers)."""
    import rollstream.engines

    source = Path(rollstream.engines.__file__).parent
    root = workdir / "extension"
    package = root / "rollstream" / "engines"
    package.mkdir(parents=True, exist_ok=True)
    for init in (root / "rollstream" / "__init__.py", package / "__init__.py"):
        init.write_text("")
    for module in SERVER_SIDE_MODULES:
        shutil.copyfile(source / f"{module}.py", package / f"{module}.py")
    return root


class LocalVLLMServer(LocalServer):
    """One vLLM server on 127.0.0.1 serving ``model`` (a local directory)."""

    START_TIMEOUT = 300.0  # 30-60 s on 2 CPU cores; more under load
    STOP_TIMEOUT = 30.0
    ORPHAN_GRACE = 3.0
    START_ERROR = VLLMStartError

    def __init__(self, workdir: Path, model: Path | str, launch: ServerLaunchConfig | None = None, *,
                 cpus: str = "", confine: bool = False, detached: bool = False) -> None:
        super().__init__(workdir, "vllm", "vllm.log", detached)
        self.launch = launch or ServerLaunchConfig()  # rollout.launch: dtype, batch, context, ...
        self.model = str(model)
        self.cpus = cpus  # "": share every core (no binding); "0" or "0-3": bind the server's threads there
        # with cpus: the whole server there (its API and engine-core processes too, not only the
        # model's threads), as a GPU server's host cores are its own
        self.confine = confine
        self._group: int | None = None  # the server's process group (its pid at start)

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    def start(self, timeout: float | None = None) -> str:
        """Start the server and block until ``/health`` answers 200; return ``url``."""
        began = time.monotonic()
        argv = server_argv(vllm_python(), self.model, self.port, self.launch)
        if self.cpus and self.confine:
            argv = ["taskset", "--cpu-list", self.cpus, *argv]  # children inherit the affinity
        env = {**os.environ, **SERVER_ENV, "PYTHONPATH": str(extension_path(self.workdir))}
        if self.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        env.pop("VIRTUAL_ENV", None)
        self._process.start(argv, cwd=self.workdir, env=env)
        self._group = self._process.pid
        self._await_ready(self._health_ok, began, timeout, 0.5, "vLLM", "did not answer /health in time")
        logger.info("vLLM ready on port %d in %.1fs (%s)", self.port, self.startup_seconds, self.model)
        return self.url

    def _health_ok(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the server (it stops its engine processes); SIGKILL the whole group after
        ``timeout`` seconds, or :data:`ORPHAN_GRACE` seconds after the API server exited
        (what it left running would otherwise hold the stop for the whole timeout)."""
        self._process.terminate()
        deadline = time.monotonic() + (self.STOP_TIMEOUT if timeout is None else timeout)
        while self._group_alive() and time.monotonic() < deadline:
            if self._process.exit_code() is not None:
                deadline = min(deadline, time.monotonic() + self.ORPHAN_GRACE)
            time.sleep(0.2)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the server and its engine processes, as a crash would."""
        if self._group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._group, signal.SIGKILL)  # the server leads its own session (ServiceProcess)
        self._process.kill()

    def _group_alive(self) -> bool:
        if self._group is None:
            return False
        self._process.exit_code()  # reaps the server once it exited (a zombie stays in the group)
        try:
            os.killpg(self._group, 0)
        except ProcessLookupError:
            return False
        return True


# ------------------------------------------------------------------ `rollstream dev up --vllm`

DEV_STATE = "vllm.json"
CMDLINE_MARK = "vllm.entrypoints.openai.api_server"


def dev_vllm_up(state_dir: Path, model: str, launch: ServerLaunchConfig | None = None) -> str:
    """Start a detached server for ``rollstream dev up --vllm`` with ``launch``'s settings (kept
    when one already runs on the same model); returns its URL."""
    state_dir = Path(state_dir).resolve()
    running = _dev_state(state_dir)
    if running is not None and pid_alive(running["pid"]) and running["model"] == model:
        return str(running["url"])
    dev_vllm_down(state_dir)
    server = LocalVLLMServer(state_dir / "vllm", model, launch, detached=True)
    server.start()
    record = {"pid": server.pid, "url": server.url, "model": model, "log": str(server.log_path)}
    (state_dir / DEV_STATE).write_text(json.dumps(record, indent=2) + "\n")
    return server.url


def dev_vllm_down(state_dir: Path) -> bool:
    """Stop the server ``dev_vllm_up`` started (its whole process group); False when none ran."""
    state = _dev_state(Path(state_dir).resolve())
    if state is None:
        return False
    pid = int(state["pid"])
    alive = pid_alive(pid) and CMDLINE_MARK in pid_cmdline(pid)
    if alive:
        stop_pid(pid, must_contain=CMDLINE_MARK)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # its engine processes
    (Path(state_dir).resolve() / DEV_STATE).unlink(missing_ok=True)
    return alive


def dev_vllm_env(state_dir: Path) -> str:
    """Export lines that point rollout workers at the dev server ("" when none runs)."""
    state = _dev_state(Path(state_dir).resolve())
    if state is None or not pid_alive(int(state["pid"])):
        return ""
    return (f"export ROLLSTREAM__ROLLOUT__ENGINE=vllm\n"
            f"export ROLLSTREAM__ROLLOUT__SERVER_URLS={shlex.quote(json.dumps([state['url']]))}\n")


def _dev_state(state_dir: Path) -> dict[str, Any] | None:
    path = state_dir / DEV_STATE
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise RuntimeError(f"unreadable {path} ({exc}); delete it by hand") from exc

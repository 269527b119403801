"""Services and processes for the broker benchmarks: Kafka + Redis, and tier processes.

``services()`` resolves Kafka and Redis like the tests do (``KAFKA_BOOTSTRAP_SERVERS`` /
``REDIS_URL``, else testcontainers, else a local broker from the cached jars and a local
redis-server). ``TierProcess`` runs one tier in its own process (``rollstream <tier>``) and
tracks its memory and CPU time (with its children, e.g. the reward process pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from bench.procstats import cpu_seconds, peak_rss_bytes, private_bytes, rss_bytes, tree_pids
from rollstream.dev.launcher import DevStack, dev_stack

REPO = Path(__file__).resolve().parent.parent
ENV_PROFILE_DIR = "ROLLSTREAM_BENCH_PROFILE_DIR"  # set: every tier process runs under py-spy


def cache_dir() -> Path:
    root = os.environ.get("ROLLSTREAM_CACHE_DIR") or Path.home() / ".cache" / "rollstream"
    return Path(root).expanduser() / "bench"


def tokenizer_path() -> Path:
    """The project's offline tiny model (its tokenizer is what the tiers load), built once."""
    from rollstream.tiny.text_model import ensure_tiny_model

    return ensure_tiny_model(cache_dir() / "tiny-model")


@contextlib.contextmanager
def services(workdir: Path) -> Iterator[DevStack]:
    """Kafka and Redis for one benchmark run (stopped afterwards if started here)."""
    with dev_stack(workdir) as dev:
        yield dev


def unique_name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def write_config(path: Path, tree: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def _die_with_parent() -> None:
    """In the child: SIGTERM when the benchmark process dies, so no tier outlives a crashed run."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class TierProcess:
    """One tier in its own process; logs to ``log_path``; ``stop()`` sends SIGTERM."""

    def __init__(self, tier: str, config: Path, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.tier = tier
        self.log_path = log_path
        argv = [sys.executable, "-m", "rollstream.cli", tier, "--config", str(config)]  # = `rollstream <tier>`
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, preexec_fn=_die_with_parent)
        self._profiler: subprocess.Popen[bytes] | None = None
        self._signalled = False
        profile_dir = os.environ.get(ENV_PROFILE_DIR)
        if profile_dir:  # py-spy (pip install py-spy) records collapsed stacks until the tier exits
            out = Path(profile_dir) / f"{tier}.collapsed"
            out.parent.mkdir(parents=True, exist_ok=True)  # py-spy writes nothing into a missing directory
            self._profiler = subprocess.Popen(
                ["py-spy", "record", "--format", "raw", "--rate", "200", "--subprocesses", "--pid", str(self.pid),
                 "-o", str(out)], stdout=subprocess.DEVNULL, stderr=self._log)
        self.peak_rss = 0  # own VmHWM, refreshed by sample()
        self.peak_tree_rss = 0  # max over samples of the RSS summed over the process and its children
        self.peak_private = 0  # max over samples of the process's private memory
        self._cpu: dict[int, float] = {}  # pid (the process and its children) -> CPU seconds seen

    @property
    def pid(self) -> int:
        return self.proc.pid

    def sample(self) -> None:
        if self.proc.poll() is not None:
            return
        self.peak_rss = max(self.peak_rss, peak_rss_bytes(self.pid))
        self.peak_private = max(self.peak_private, private_bytes(self.pid))
        pids = tree_pids(self.pid)
        self.peak_tree_rss = max(self.peak_tree_rss, sum(rss_bytes(p) for p in pids))
        for p in pids:
            self._cpu[p] = max(self._cpu.get(p, 0.0), cpu_seconds(p))

    @property
    def cpu_seconds(self) -> float:
        """CPU seconds of the process and its children, as last sampled."""
        return sum(self._cpu.values())

    def logged(self, text: str) -> bool:
        """True once the tier's log holds ``text``."""
        try:
            return text in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def running(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None and code != 0:
            raise RuntimeError(f"{self.tier} exited with {code}; log {self.log_path}:\n{tail(self.log_path)}")

    def signal_stop(self) -> None:
        """Ask the tier to stop (SIGTERM: it finishes in-flight work, commits, closes)."""
        self.sample()
        if self.proc.poll() is None and not self._signalled:
            self._signalled = True  # once: a second SIGTERM makes a tier exit at once
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int | None:
        self.signal_stop()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._profiler is not None:
            try:
                self._profiler.wait(30)
            except subprocess.TimeoutExpired:
                self._profiler.kill()
        self._log.close()
        return self.proc.returncode


def stop_all(procs: list[TierProcess], timeout: float = 30.0) -> None:
    """Stop every process, all at once (each shuts down gracefully in parallel)."""
    for p in procs:
        p.signal_stop()
    for p in procs:
        p.stop(timeout)


class Sampler:
    """Samples the memory of ``processes`` every ``interval`` seconds in a thread."""

    def __init__(self, processes: list[TierProcess], interval: float = 0.5) -> None:
        self.processes = processes
        self.cpu_seconds = 0.0  # the sampler's own CPU time (this process's, not the trainer's)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            start = time.thread_time()
            for p in list(self.processes):
                p.sample()
            self.cpu_seconds += time.thread_time() - start

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# Every consuming tier logs "<tier> <id> consuming <topic>" once its consumer has started.
READY_TEXT = " consuming "


async def wait_until_consuming(procs: list[TierProcess], timeout: float) -> None:
    """Return once every process in ``procs`` logged that it consumes (cheap: reads their logs);
    raises if one exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not all(p.logged(READY_TEXT) for p in procs):
        for p in procs:
            p.check_alive()
            if not p.running():
                raise RuntimeError(f"{p.tier} ended before consuming; log {p.log_path}:\n{tail(p.log_path)}")
        if time.monotonic() > deadline:
            waiting = [p.tier for p in procs if not p.logged(READY_TEXT)]
            raise TimeoutError(f"{waiting} did not log {READY_TEXT.strip()!r} within {timeout:.0f}s")
        await asyncio.sleep(0.2)

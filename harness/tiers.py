"""Tier processes: :class:`TierProcess` runs one tier in its own process (``rollstream <tier>``),
the one way the tests and the benchmarks start a tier, and tracks its memory and CPU time (with
its children, e.g. the reward process pool); :func:`running` keeps a set of them for one block.
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
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

from harness.procstats import cpu_seconds, peak_rss_bytes, private_bytes, rss_bytes, tree_pids


REPO = Path(__file__).resolve().parent.parent
ENV_PROFILE_DIR = "ROLLSTREAM_BENCH_PROFILE_DIR"  # set: every tier process runs under py-spy
CONFIG_ENV = ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL")  # settings a tier reads from its environment
CONFIG_ENV_PREFIX = "ROLLSTREAM__"


try:  # loaded here: no dlopen between fork and exec
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None


def _die_with_parent() -> None:
    """In the child: SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG), so no tier
    outlives a crashed run. Start tiers from a thread that lives as long as the run (the main
    thread), not from a short-lived worker thread."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)


class TierProcess:
    """One tier replica in its own process (``rollstream <tier>``): the one way the tests and the
    benchmarks start a tier.

    Not started by the constructor: ``start()`` (again after ``kill()`` or ``stop()``: a restart
    with the same settings and log). Each start runs in its own session (process group), so a
    kill, pause or stop reaches what the tier started (the reward worker's process pool; the
    trainer's ``torchrun`` workers, which run in sessions of their own, through the process
    tree), as the death of a container would. Output is appended to ``log_path``, a line per
    start; ``tail()`` and ``grep()`` read it. ``sample()`` tracks memory and CPU time (with the
    children). ``args`` follow the config on the command line (``rollstream train``'s
    ``--steps-file``); ``overrides`` become ``--set`` options. The settings are the config file
    (none: defaults and ``overrides`` alone), the overrides and ``env``: the config variables of
    this process's environment (``KAFKA_BOOTSTRAP_SERVERS``, ``REDIS_URL``, ``ROLLSTREAM__*``,
    which would win over the file) are not passed on; ``env`` adds to the environment.
    ``module`` is what runs as ``python -m <module> <tier> ...``: ``rollstream.cli``, or a
    wrapper with the same command line (the tests' torch tripwire).
    """

    def __init__(self, tier: str, config: Path | None, log_path: Path, *, overrides: list[str] | None = None,
                 env: dict[str, str] | None = None, args: list[str] | None = None, name: str | None = None,
                 module: str = "rollstream.cli") -> None:
        self.tier = tier
        self.name = name or tier
        self.module = module
        self.config = config
        self.log_path = log_path
        self.overrides = list(overrides or [])
        self.args = list(args or [])
        self.env = dict(env or {})
        self.starts = 0
        self.kills = 0
        self.pauses = 0
        self.unexpected_exits: list[int] = []  # exit codes of exits nobody asked for (a supervisor fills it)
        self.held_down = False  # killed or stopped on purpose: not to be restarted by a supervisor
        self.peak_rss = 0  # own VmHWM, refreshed by sample()
        self.peak_tree_rss = 0  # max over samples of the RSS summed over the process and its children
        self.peak_private = 0  # max over samples of the process's private memory
        self._cpu: dict[int, float] = {}  # pid (the process and its children) -> CPU seconds seen
        self._proc: subprocess.Popen[bytes] | None = None
        self._profiler: subprocess.Popen[bytes] | None = None
        self._signalled = False

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", self.module, self.tier]
        if self.config is not None:
            argv += ["--config", str(self.config)]
        argv += self.args
        for item in self.overrides:  # = `rollstream <tier> --config F ... --set K=V`
            argv += ["--set", item]
        return argv

    def start(self) -> TierProcess:
        """Start (or restart) the tier; returns self."""
        if self.running():
            raise RuntimeError(f"{self.name} is already running")
        self.held_down = False
        self._signalled = False
        inherited = {k: v for k, v in os.environ.items() if k not in CONFIG_ENV and not k.startswith(CONFIG_ENV_PREFIX)}
        env = {**inherited, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **self.env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} start #{self.starts + 1} of {self.name}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(self.argv(), cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=_die_with_parent)
        self.starts += 1
        profile_dir = os.environ.get(ENV_PROFILE_DIR)
        if profile_dir:  # py-spy (pip install py-spy) records collapsed stacks until the tier exits
            restart = f".{self.starts}" if self.starts > 1 else ""
            out = Path(profile_dir) / f"{self.name}{restart}.collapsed"
            out.parent.mkdir(parents=True, exist_ok=True)  # py-spy writes nothing into a missing directory
            with self.log_path.open("ab") as log:
                self._profiler = subprocess.Popen(
                    ["py-spy", "record", "--format", "raw", "--rate", "200", "--subprocesses", "--pid",
                     str(self.pid), "-o", str(out)], stdout=subprocess.DEVNULL, stderr=log)
        return self

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self._proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def exit_code(self) -> int | None:
        """None while it runs (or before its first start)."""
        return None if self._proc is None else self._proc.poll()

    def wait(self, timeout: float) -> int:
        """Wait for the tier to exit on its own; its exit code (raises on timeout)."""
        return self.proc.wait(timeout)

    def check_alive(self) -> None:
        """Raise if the tier exited with a non-zero code."""
        code = self.exit_code()
        if code is not None and code != 0:
            raise RuntimeError(f"{self.name} exited with {code}; log {self.log_path}:\n{tail(self.log_path)}")

    # -- faults and stops --

    def kill(self) -> None:
        """SIGKILL the tier and everything it started; reaped before returning."""
        self.held_down = True
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        self.sample()
        _signal_tree(proc.pid, signal.SIGKILL)
        proc.wait(30)
        self.kills += 1

    def pause(self) -> None:
        """SIGSTOP the tier and its children: a GC pause, a stalled VM, a network hiccup."""
        if self.running():
            _signal_tree(self.pid, signal.SIGSTOP)
            self.pauses += 1

    def resume(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            _signal_tree(self._proc.pid, signal.SIGCONT)

    def signal_stop(self) -> None:
        """Ask the tier to stop (SIGTERM to its main process, as an orchestrator does: it stops
        taking work, finishes or hands back what is in flight, commits and closes). Once: a second
        SIGTERM makes a tier exit at once."""
        proc = self._proc
        if proc is None or proc.poll() is not None or self._signalled:
            return
        self.sample()
        self._signalled = True
        _signal_tree(proc.pid, signal.SIGCONT)  # a paused tier cannot stop gracefully
        proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60.0) -> int | None:
        """:meth:`signal_stop`, SIGKILL after ``timeout``; returns the exit code (None if never
        started). Nothing it started outlives it."""
        self.held_down = True
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            self.signal_stop()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_tree(proc.pid, signal.SIGKILL)
                proc.wait(30)
        _signal_group(proc.pid, signal.SIGKILL)  # a graceful stop leaves no orphans behind either
        if self._profiler is not None:
            try:
                self._profiler.wait(30)
            except subprocess.TimeoutExpired:
                self._profiler.kill()
            self._profiler = None
        return proc.returncode

    def wait_probe(self, port: int, path: str, status: int = 200, timeout: float = 90.0) -> str:
        """Poll the tier's health/metrics server on ``port`` until ``path`` answers ``status``;
        the body. Raises if the tier exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                raise RuntimeError(f"{self.name} exited with {self.exit_code()}\n{self.tail()}")
            answer = probe(port, path)
            if answer is not None and answer[0] == status:
                return answer[1]
            time.sleep(0.3)
        raise TimeoutError(f"{path} never answered {status}; last {probe(port, path)}\n{self.tail()}")

    # -- what it did --

    def sample(self) -> None:
        if not self.running():
            return
        self.peak_rss = max(self.peak_rss, peak_rss_bytes(self.pid))
        self.peak_private = max(self.peak_private, private_bytes(self.pid))
        pids = tree_pids(self.pid)
        self.peak_tree_rss = max(self.peak_tree_rss, sum(rss_bytes(p) for p in pids))
        for p in pids:
            self._cpu[p] = max(self._cpu.get(p, 0.0), cpu_seconds(p))

    @property
    def cpu_seconds(self) -> float:
        """CPU seconds of the process and its children (every start), as last sampled."""
        return sum(self._cpu.values())

    def logged(self, text: str) -> bool:
        """True once the tier's log holds ``text``."""
        try:
            return text in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def grep(self, needle: str) -> list[str]:
        """The log's lines that hold ``needle`` (every start)."""
        try:
            return [line for line in self.log_path.read_text(errors="replace").splitlines() if needle in line]
        except FileNotFoundError:
            return []

    def tail(self, lines: int = 30) -> str:
        """The log's last ``lines`` lines, headed by its path (for assertion messages)."""
        try:
            with self.log_path.open("r", errors="replace") as handle:
                return f"--- {self.log_path}:\n" + "".join(deque(handle, maxlen=lines))
        except FileNotFoundError:
            return f"(no log at {self.log_path})"


def probe(port: int, path: str) -> tuple[int, str] | None:
    """``(status, body)`` of ``GET http://127.0.0.1:<port><path>``, or None while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_tree(pid: int, sig: signal.Signals) -> None:
    """``sig`` to the process group of ``pid`` and to every descendant (some run in sessions of
    their own: torchrun's workers); the tree is read before anything is signalled."""
    pids = tree_pids(pid)
    _signal_group(pid, sig)
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


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


@contextlib.contextmanager
def running(config: Path, logdir: Path, names: Iterable[str]) -> Iterator[dict[str, TierProcess]]:
    """The tiers ``names`` (``<tier>`` or ``<tier>#<n>``) started on ``config``, by name, each
    logging to ``<logdir>/<name>.log``; tiers added to the dict are kept too. Whatever still runs
    at the end is killed (with what it started)."""
    tiers = {name: TierProcess(name.split("#")[0], config, logdir / f"{name}.log", name=name).start()
             for name in names}
    try:
        yield tiers
    finally:
        for tier in tiers.values():
            tier.kill()


def check_alive(tiers: dict[str, TierProcess]) -> None:
    """Every tier runs or exited 0 (a producer whose dataset is done)."""
    assert all(t.exit_code() in (None, 0) for t in tiers.values()), tails(tiers)


def stop_cleanly(tiers: dict[str, TierProcess]) -> None:
    """The producers exit 0 on their own once their dataset is published; every other tier
    exits 0 on SIGTERM, within a minute."""
    for tier in tiers.values():
        if tier.tier == "producer":
            assert tier.wait(30) == 0, tier.tail()
    codes = {name: tier.stop(60) for name, tier in tiers.items() if tier.tier != "producer"}
    assert all(code == 0 for code in codes.values()), (codes, tails(tiers))


def tails(tiers: dict[str, TierProcess]) -> str:
    return "\n".join(tier.tail() for tier in tiers.values())

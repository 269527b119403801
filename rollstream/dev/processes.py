"""Child-process plumbing shared by the local Kafka broker and the local Redis server.

A `ServiceProcess` runs one long-lived server process with its stdout and stderr appended to a log
file. It always starts the child in a new session, so a Ctrl-C in the terminal reaches only the
Python process (which then stops the child in order) and so a detached child outlives its parent.
Non-detached children are killed at interpreter exit as a last resort.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"
_random = random.SystemRandom()  # independent of any random.seed() a test may call
_handed_out: set[int] = set()


class MissingToolError(RuntimeError):
    """A program the local dev services need (java, mvn, redis-server) is not installed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the ephemeral range.

    Outside the ephemeral range, no client connection can take the port as its source port
    while a server is down for a restart (which would also let a reconnecting client connect
    to itself and keep the port busy).
    """
    low, high = 10000, _ephemeral_start()
    for _ in range(100):
        port = _random.randrange(low, high)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)  # never twice in one process, even before it is bound
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # let the OS pick
        sock.bind((LOCALHOST, 0))
        return int(sock.getsockname()[1])


def _ephemeral_start() -> int:
    try:
        start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        start = 32768
    return max(start, 10001)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOCALHOST, port))
        except OSError:
            return False
    return True


def port_open(port: int, host: str = LOCALHOST, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def pid_cmdline(pid: int) -> str:
    """The command line of a process as one space-joined string ("" when unknown)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", errors="replace")


def stop_pid(pid: int, must_contain: str, timeout: float = 30.0) -> bool:
    """SIGTERM a process that is not our child, then SIGKILL after `timeout` seconds.

    The pid is signalled only while its command line contains `must_contain`, so a pid reused by
    an unrelated process is left alone. Returns True when the process is gone afterwards.
    """
    if not pid_alive(pid):
        return True
    if must_contain not in pid_cmdline(pid):
        logger.warning("pid %d is no longer %r; not signalling it", pid, must_contain)
        return True
    os.kill(pid, signal.SIGTERM)
    if _wait_gone(pid, timeout):
        return True
    logger.warning("pid %d ignored SIGTERM for %.0fs; sending SIGKILL", pid, timeout)
    os.kill(pid, signal.SIGKILL)
    return _wait_gone(pid, 10.0)


def terminate_pid(pid: int, must_contain: str) -> None:
    """SIGTERM a process that is not our child, without waiting; only while its command line
    contains `must_contain` (see `stop_pid`)."""
    if pid_alive(pid) and must_contain in pid_cmdline(pid):
        os.kill(pid, signal.SIGTERM)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return not pid_alive(pid)


class ServiceProcess:
    """One server process whose output is appended to `log_path`.

    `start()` may be called again after `stop()` or `kill()`; each start appends to the same log.
    """

    def __init__(self, name: str, log_path: Path, detached: bool = False) -> None:
        self.name = name
        self.log_path = log_path
        self.detached = detached
        self._proc: subprocess.Popen[bytes] | None = None
        self._atexit_registered = False

    @property
    def pid(self) -> int | None:
        proc = self._live()
        return None if proc is None else proc.pid

    def start(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        """Start `argv` with cwd `cwd`; raises RuntimeError when this one is still running."""
        if self.is_running():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} starting {self.name}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        if not self.detached and not self._atexit_registered:
            atexit.register(self.kill)
            self._atexit_registered = True
        logger.debug("%s started: pid %d", self.name, self._proc.pid)

    def is_running(self) -> bool:
        """True while the child started by the last `start()` has not exited."""
        return self._live() is not None

    def _live(self) -> subprocess.Popen[bytes] | None:
        return self._proc if self._proc is not None and self._proc.poll() is None else None

    def exit_code(self) -> int | None:
        """The exit status of the last child, or None while it runs or when none was started."""
        return None if self._proc is None else self._proc.poll()

    def terminate(self) -> None:
        """SIGTERM without waiting (several servers then shut down side by side)."""
        proc = self._live()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, wait up to `timeout` seconds, then SIGKILL. No-op when not running."""
        proc = self._live()
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s ignored SIGTERM for %.0fs; killing it", self.name, timeout)
            self.kill()

    def kill(self) -> None:
        """SIGKILL the child and reap it. No-op when not running."""
        proc = self._live()
        if proc is not None:
            proc.kill()
            proc.wait()


class LocalServer:
    """What the local broker, redis-server and vLLM server share: a working directory, a port chosen
    once (kept across restarts), one `ServiceProcess` and its lifecycle.

    Subclasses implement `start(timeout) -> address`; `START_TIMEOUT` and `STOP_TIMEOUT` are their
    default waits; `START_ERROR` is what a failed start raises.
    """

    START_TIMEOUT = 30.0
    STOP_TIMEOUT = 10.0
    START_ERROR: type[RuntimeError] = RuntimeError
    startup_seconds: float | None = None  # the last start's, until the server was ready

    def __init__(self, workdir: Path, name: str, log_name: str, detached: bool) -> None:
        self.workdir = Path(workdir).resolve()
        self.port = free_port()
        self._process = ServiceProcess(name, self.workdir / log_name, detached)

    def start(self, timeout: float | None = None) -> str:
        raise NotImplementedError

    @property
    def log_path(self) -> Path:
        """The file that receives the server's stdout and stderr (appended across restarts)."""
        return self._process.log_path

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def is_running(self) -> bool:
        """True while the server process is alive (ready or not)."""
        return self._process.is_running()

    def exit_code(self) -> int | None:
        """The exit status of the server process once it exited (None while it runs)."""
        return self._process.exit_code()

    def stop(self, timeout: float | None = None) -> None:
        """Shut down cleanly (SIGTERM); SIGKILL if still alive after `timeout` seconds."""
        self._process.stop(self.STOP_TIMEOUT if timeout is None else timeout)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would."""
        self._process.kill()

    def terminate(self) -> None:
        """Ask the server to shut down (SIGTERM) without waiting; `stop()` then waits."""
        self._process.terminate()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): it accepts connections and answers nothing, its clock
        runs on (keys expire when it wakes), as a stalled host or a network partition."""
        if self.pid is not None:
            os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Wake a paused server (SIGCONT)."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it may have exited just now
                os.kill(self.pid, signal.SIGCONT)

    def _await_ready(self, ready: Callable[[], bool], began: float, timeout: float | None,
                     interval: float, what: str, not_ready: str) -> None:
        """Poll `ready()` every `interval` seconds until it holds, then set `startup_seconds` from
        `began`. Kills the server and raises `START_ERROR` (with the log's tail) when it exits or is
        not ready `timeout` seconds (None: `START_TIMEOUT`) after `began`."""
        deadline = began + (self.START_TIMEOUT if timeout is None else timeout)
        try:
            while time.monotonic() < deadline:
                if not self.is_running():
                    self._fail(f"{what} exited with {self._process.exit_code()}")
                if ready():
                    self.startup_seconds = time.monotonic() - began
                    return
                time.sleep(interval)
            self._fail(f"{what} {not_ready}")
        except BaseException:
            self.kill()
            raise

    def _fail(self, why: str) -> None:
        try:
            with self.log_path.open("r", encoding="utf-8", errors="replace") as handle:
                tail = "".join(deque(handle, maxlen=40))
        except FileNotFoundError:
            tail = f"(no log at {self.log_path})"
        raise self.START_ERROR(f"{why}; last lines of {self.log_path}:\n{tail}")

    def restart(self, timeout: float | None = None) -> str:
        """Stop (cleanly) and start again on the same ports and data directory."""
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

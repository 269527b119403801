"""Tier processes for fault tests: start, SIGKILL, restart and stop `python -m rollstream.cli <tier>`.

Each tier runs in its own session (process group), so a kill takes its children too (the reward
worker's process pool), as the death of a container would. Output is appended to one log file per
tier; `tail()` shows its end for assertion messages.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class TierProcess:
    """One tier replica; `start()` again after `kill()` restarts it with the same settings."""

    def __init__(self, tier: str, config_file: Path, log_dir: Path, overrides: list[str] | None = None,
                 name: str | None = None) -> None:
        self.tier = tier
        self.name = name or tier
        self.config_file = config_file
        self.overrides = list(overrides or [])
        self.log_path = log_dir / f"{self.name}.log"
        self.starts = 0
        self.kills = 0
        self.pauses = 0
        self.unexpected_exits: list[int] = []  # exit codes of exits nobody asked for
        self.held_down = False  # killed or stopped on purpose: not to be restarted by a supervisor
        self._proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "rollstream.cli", self.tier, "--config", str(self.config_file)]
        for item in self.overrides:
            argv += ["--set", item]
        return argv

    def start(self) -> None:
        if self.running():
            raise RuntimeError(f"{self.name} is already running")
        self.held_down = False
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with self.log_path.open("ab") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} start #{self.starts + 1} of {self.name}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(self.argv(), cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def kill(self) -> None:
        """SIGKILL the tier and everything it started; reaped before returning."""
        self.held_down = True
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait(30)
        self.kills += 1

    def pause(self) -> None:
        """SIGSTOP the tier and its children: a GC pause, a stalled VM, a network hiccup."""
        if self.running():
            _signal_group(self._proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            self.pauses += 1

    def resume(self) -> None:
        if self._proc is not None:
            _signal_group(self._proc.pid, signal.SIGCONT)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (graceful stop), SIGKILL after ``timeout``; returns the exit code."""
        self.held_down = True
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGCONT)  # a paused tier cannot stop gracefully
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(30)
        # a graceful stop leaves no orphans behind either
        _signal_group(proc.pid, signal.SIGKILL)
        return proc.returncode

    def tail(self, lines: int = 30) -> str:
        try:
            with self.log_path.open("r", errors="replace") as handle:
                return f"--- {self.log_path}:\n" + "".join(deque(handle, maxlen=lines))
        except FileNotFoundError:
            return f"(no log at {self.log_path})"

    def grep(self, needle: str) -> list[str]:
        try:
            return [line for line in self.log_path.read_text(errors="replace").splitlines() if needle in line]
        except FileNotFoundError:
            return []


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass

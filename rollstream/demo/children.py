"""The tier processes the demo starts: ``python -m rollstream.cli <tier> --config F``.

Each child runs in its own session (a Ctrl-C in the terminal reaches only the demo, which
then stops the children in order) with its output in ``<log_dir>/<name>.log``. ``stop_all``
sends SIGTERM to every child at once, waits up to a grace period, then SIGKILLs the rest;
children still running at interpreter exit are killed.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def tier_argv(tier: str, config_path: Path, overrides: list[str] | None = None) -> list[str]:
    """The command line of one tier process."""
    argv = [sys.executable, "-m", "rollstream.cli", tier, "--config", str(config_path)]
    for item in overrides or []:
        argv += ["--set", item]
    return argv


@dataclass
class ChildGroup:
    """Starts and stops a set of children; every one it started is stopped by :meth:`stop_all`."""

    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)
    _atexit: bool = False

    def start(self, name: str, argv: list[str], cwd: Path | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child(name, argv, self.log_dir / f"{name}.log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with child.log_path.open("ab") as out:
            child.proc = subprocess.Popen(
                argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.children.append(child)
        if not self._atexit:
            atexit.register(self.kill_all)
            self._atexit = True
        log.info("started %s (pid %d), log %s", name, child.pid, child.log_path)
        return child

    def failed(self) -> list[Child]:
        """Children that exited with a non-zero status (a tier that crashed)."""
        return [c for c in self.children if c.proc is not None and c.proc.poll() not in (None, 0)]

    def stop_all(self, grace_seconds: float = 20.0) -> dict[str, int | None]:
        """SIGTERM all, wait up to ``grace_seconds`` in total, SIGKILL the rest; exit codes by name."""
        for child in self.children:
            if child.running():
                assert child.proc is not None
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for child in self.children:
            assert child.proc is not None
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %.0fs; killing it", child.name, grace_seconds)
                child.proc.kill()
                child.proc.wait(10)
        return {child.name: child.proc.returncode if child.proc else None for child in self.children}

    def kill_all(self) -> None:
        """Last resort (interpreter exit): SIGKILL whatever still runs."""
        for child in self.children:
            if child.running():
                assert child.proc is not None
                child.proc.kill()
                child.proc.wait(10)

"""The tier processes the demo starts: ``python -m rollstream.cli <tier> --config F``.

Each child is a :class:`~rollstream.dev.processes.ServiceProcess` (its own session, so a
Ctrl-C in the terminal reaches only the demo, which then stops the children in order; output
in ``<log_dir>/<name>.log``; killed at interpreter exit if still running). ``stop_all`` sends
SIGTERM to every child at once, waits up to a grace period, then SIGKILLs the rest.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollstream.dev.processes import ServiceProcess

log = logging.getLogger(__name__)


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
    children: list[ServiceProcess] = field(default_factory=list)

    def start(self, name: str, argv: list[str], cwd: Path | None = None) -> ServiceProcess:
        child = ServiceProcess(name, self.log_dir / f"{name}.log")
        child.start(argv, cwd or Path.cwd(), env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})
        self.children.append(child)
        log.info("started %s (pid %s), log %s", name, child.pid, child.log_path)
        return child

    def failed(self) -> list[ServiceProcess]:
        """Children that exited with a non-zero status (a tier that crashed)."""
        return [c for c in self.children if c.exit_code() not in (None, 0)]

    def stop_all(self, grace_seconds: float = 20.0) -> dict[str, int | None]:
        """SIGTERM all, wait up to ``grace_seconds`` in total, SIGKILL the rest; exit codes by name."""
        for child in self.children:
            child.terminate()
        deadline = time.monotonic() + grace_seconds
        for child in self.children:
            child.stop(max(0.0, deadline - time.monotonic()))
        return {child.name: child.exit_code() for child in self.children}

    def kill_all(self) -> None:
        """Last resort: SIGKILL whatever still runs."""
        for child in self.children:
            child.kill()

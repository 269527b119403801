"""Run harness/trainer_job.py as a torchrun job the way ``rollstream train`` runs a
trainer (:func:`rollstream.demo.example_trainer.launcher_argv`: torchrun with restarts), read
its ranks' logs, and hurt its ranks (SIGKILL, SIGSTOP) at a step of a given run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from rollstream.demo.example_trainer import TORCHRUN_ENV, launcher_argv


REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "harness/trainer_job.py"
# What a rank's stderr says when it ends abnormally (an uncaught C++ exception, a fatal signal).
WHY_A_RANK_ENDED = ("terminate called", "what():", "Fatal Python error", "Error", "Exception", "Signal ")


class TrainerJob:
    """One torchrun job of trainer_job.py with its own directory (``out``), config and logs."""

    def __init__(self, name: str, ranks: int, tree: dict[str, Any], workdir: Path, *, steps: int,
                 max_restarts: int, job_args: list[str]) -> None:
        self.name, self.ranks, self.steps, self.max_restarts = name, ranks, steps, max_restarts
        self.out = workdir / name
        self.out.mkdir()
        self.config_tree = tree
        self.config = self.out / "config.yaml"
        self.config.write_text(yaml.safe_dump(tree))
        self.job_args = job_args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [*launcher_argv(JOB, self.ranks, self.max_restarts), "--config", str(self.config),
                "--out", str(self.out), "--steps", str(self.steps), *self.job_args]
        env = {**os.environ, **TORCHRUN_ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        with (self.out / "torchrun.log").open("ab") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def events(self, rank: int) -> list[dict[str, Any]]:
        path = self.out / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def log_text(self, rank: int) -> str:
        path = self.out / f"rank{rank}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def in_step(self, rank: int, step: int, restart: int) -> int | None:
        """The pid of ``rank`` while it is inside ``step`` of run ``restart`` (started, not committed)."""
        events = [e for e in self.events(rank) if e["restart"] == restart and e.get("step") == step]
        if [e["event"] for e in events] == ["start"]:
            return int(events[0]["pid"])
        return None

    def tail(self, lines: int = 40) -> str:
        """The end of torchrun's output, every line of it that says why a rank ended (a rank's
        stderr comes before torchrun's own report), and the end of each rank's log."""
        everything = (self.out / "torchrun.log").read_text(errors="replace").splitlines()
        text = everything[-lines:]
        why = [line for line in everything[:-lines] if any(mark in line for mark in WHY_A_RANK_ENDED)]
        if why:
            text = ["--- why ranks ended (earlier in torchrun.log) ---", *why[-20:], "--- torchrun.log ---", *text]
        ranks = [f"--- rank {r} ---\n" + "\n".join(self.log_text(r).splitlines()[-15:]) for r in range(self.ranks)]
        return "\n".join(text + ranks)

    async def hurt(self, rank: int, step: int, restart: int, sig: signal.Signals, timeout: float,
                   tick: Callable[[], None] = lambda: None) -> int:
        """Send ``sig`` to ``rank`` once it is inside ``step`` of run ``restart``; its pid."""
        deadline = time.monotonic() + timeout
        while (pid := self.in_step(rank, step, restart)) is None:
            tick()
            assert self.running, f"{self.name} ended early\n{self.tail()}"
            assert time.monotonic() < deadline, f"{self.name}: rank {rank} never reached step {step} of run {restart}\n{self.tail()}"
            await asyncio.sleep(0.05)
        os.kill(pid, sig)
        return pid

    async def wait(self, timeout: float, tick: Callable[[], None] = lambda: None) -> int:
        """Wait for torchrun to end; its exit status."""
        deadline = time.monotonic() + timeout
        while self.running:
            tick()
            assert time.monotonic() < deadline, f"{self.name} did not finish in {timeout:.0f}s\n{self.tail()}"
            await asyncio.sleep(0.2)
        assert self.proc is not None
        return self.proc.returncode

    def stop(self) -> None:
        """Kill torchrun and every worker it started (they run in sessions of their own)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in {e["pid"] for r in range(self.ranks) for e in self.events(r)}:
            with contextlib.suppress(OSError):  # gone already; and a reused pid is not ours
                if "trainer_job.py" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)


def pid_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: it no longer runs)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in (b"Z", b"X")

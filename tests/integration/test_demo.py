"""The shortened demo end to end: real broker, real Redis, every tier as a process, the trainer.

The first test runs ``rollstream demo`` the way a user does (services from the environment, or
started locally and stopped again); the second interrupts a run with SIGINT. Both check that
no process the demo started survives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollstream.dev.launcher import Services
from rollstream.dev.processes import pid_alive

pytestmark = [pytest.mark.slow]

SMALL = ["--no-live", "--warmup-steps", "50", "--prompts-per-step", "2", "--group-size", "4"]


def _demo(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "rollstream.cli", "demo", "--run-dir", str(run_dir), *SMALL, *args]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _started_pids(run_dir: Path) -> dict[str, int]:
    record = json.loads((run_dir / "processes.json").read_text())
    return {**record["children"], **record["services"]}


def _assert_all_gone(pids: dict[str, int]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(pid_alive(pid) for pid in pids.values()):
        time.sleep(0.2)
    alive = {name: pid for name, pid in pids.items() if pid_alive(pid)}
    assert not alive, f"still running after the demo: {alive}"


def test_short_demo_trains_and_rollout_workers_follow(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _demo(run_dir, "--steps", "3")
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    assert "reward mean first 5 steps:" in output and "/ last 5 steps:" in output

    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1, 2, 3]  # a version published per step
    assert all(s["groups"] == 2 and s["episodes"] == 8 for s in steps)  # batches flowed
    assert (run_dir / "reward_per_step.png").stat().st_size > 0
    assert (run_dir / "ckpt" / "v3" / "config.json").is_file()

    rollout_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "now generating with weight version 1 " in rollout_log  # the worker reloaded weights
    assert list((run_dir / "dumps").rglob("*.jsonl")), "the dump tier wrote nothing"
    _assert_all_gone(_started_pids(run_dir))


@pytest.mark.broker
def test_sigint_stops_every_process_the_demo_started(tmp_path: Path, services: Services) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": services.kafka_bootstrap, "REDIS_URL": services.redis_url}
    proc = _demo(run_dir, "--steps", "1000", env=env)
    try:
        deadline = time.monotonic() + 180
        steps = run_dir / "steps.jsonl"
        while len(steps.read_text().splitlines() if steps.exists() else []) < 2:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the demo trained no 2 steps in time"
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "interrupted" in output
    assert len((run_dir / "steps.jsonl").read_text().splitlines()) >= 2
    _assert_all_gone(_started_pids(run_dir))

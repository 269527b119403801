"""A real tier process answers its health probes: live at once, ready only once it consumes
(not while it waits for an unreachable Kafka), and its metrics beside them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.fakes import free_port

pytestmark = [pytest.mark.broker, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]


def get(port: int, path: str) -> tuple[int, str] | None:
    """(status, body), or None while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return None


def wait_for(port: int, path: str, status: int, proc: subprocess.Popen[bytes], log: Path,
             timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the tier exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        answer = get(port, path)
        if answer is not None and answer[0] == status:
            return answer[1]
        time.sleep(0.3)
    raise AssertionError(f"{path} never answered {status}; last {get(port, path)}\n{log.read_text()[-3000:]}")


def start_grouping(tmp_path: Path, bootstrap: str, redis_url: str, name: str, port: int) -> tuple[subprocess.Popen[bytes], Path]:
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "kafka": {"bootstrap_servers": bootstrap, "partitions": 2},
        "redis": {"url": redis_url},
        "experiment": {"experiment_name": name, "trial_name": "t0"},
        "grouping": {"instance_id": "g0", "session_timeout_ms": 6000},
        "metrics": {"port": port},
    }))
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        # the file alone decides (the environment would win over it)
        env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL")
               and not k.startswith("ROLLSTREAM__")}
        proc = subprocess.Popen([sys.executable, "-m", "rollstream.cli", "grouping", "--config", str(config)],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, log


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def test_a_tier_waiting_for_kafka_is_live_but_not_ready(tmp_path: Path, redis_url: str, unique_name: str) -> None:
    port = free_port()
    proc, log = start_grouping(tmp_path, f"127.0.0.1:{free_port()}", redis_url, unique_name, port)  # nobody there
    try:
        assert wait_for(port, "/livez", 200, proc, log) == "ok\n"
        time.sleep(2)  # it keeps trying to reach Kafka
        assert get(port, "/readyz") == (503, "starting\n")
    finally:
        proc.kill()  # a tier still waiting for Kafka at start finishes that wait before a SIGTERM
        proc.wait(10)


def test_a_consuming_tier_is_ready_and_serves_its_metrics(tmp_path: Path, kafka_bootstrap: str, redis_url: str,
                                                          unique_name: str) -> None:
    port = free_port()
    proc, log = start_grouping(tmp_path, kafka_bootstrap, redis_url, unique_name, port)
    try:
        assert wait_for(port, "/readyz", 200, proc, log) == "ok\n"
        assert get(port, "/livez") == (200, "ok\n")
        metrics = get(port, "/metrics")
        assert metrics is not None and metrics[0] == 200 and "rollstream_open_groups" in metrics[1]
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]

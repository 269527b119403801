"""The benchmark scripts still run (tiny sizes, ``--quick``); CI times nothing.

The broker benchmarks run as ``python -m bench.<name> --quick`` in a subprocess against the
session's broker and Redis (passed through KAFKA_BOOTSTRAP_SERVERS / REDIS_URL); the others
run in this process. Each must write its JSON results with at least one non-empty table, with
the rows a reader looks for, and ``bench.summary`` must still find its headline tables in them
(a renamed table fails here, not in ``bench/run_all.sh``). Target verdicts are ignored: quick
sizes measure nothing. ``tests/unit/test_entry_points_covered.py`` checks that every benchmark
has a test here (or elsewhere, or an exemption).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import summary
from bench.common import RESULTS_DIR
from rollstream.dev.vllm_server import LocalVLLMServer

REPO = Path(__file__).resolve().parents[2]


def run_bench(name: str, out: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120.0) -> dict:
    path = out / f"{name}.json"
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--quick", "--out", str(path), *args],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )
    output = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode in (0, 1), f"bench.{name} exited {done.returncode}:\n{output}"
    assert path.exists(), f"bench.{name} wrote no results:\n{output}"
    results = json.loads(path.read_text())
    check_tables(name, results)
    return results


def check_tables(name: str, results: dict[str, Any]) -> None:
    """Non-empty tables, and for the benchmarks ``bench.summary`` tabulates, its headline rows."""
    assert results["tables"] and all(results["tables"].values()), f"bench.{name} produced an empty table"
    if name in summary.ORDER:
        assert summary.headline(name, results), f"bench.summary finds no figure in bench.{name}'s results"


@pytest.mark.parametrize("name, args", [("codec", []), ("grouping", []), ("inprocess", []), ("memory", ["--skip-tiers"]),
                                        ("reward", ["--rounds", "1"])])
def test_broker_free_benchmarks_run(name: str, args: list[str], tmp_path: Path) -> None:
    # in this process (no interpreter and torch start-up per script); memory's --skip-tiers:
    # the tiers' memory comes from the pipeline run that the pipeline smoke test exercises
    module = importlib.import_module(f"bench.{name}")
    path = tmp_path / f"{name}.json"
    assert module.main(["--quick", "--out", str(path), *args]) in (0, 1)
    check_tables(name, json.loads(path.read_text()))


@pytest.fixture
def broker_env(kafka_bootstrap: str, redis_url: str) -> dict[str, str]:
    return {"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "REDIS_URL": redis_url}


@pytest.mark.broker
def test_pipeline_benchmark_runs(broker_env: dict[str, str], tmp_path: Path) -> None:
    results = run_bench("pipeline", tmp_path, env=broker_env)
    assert results["extra"]["episodes"] == 4 * 8
    memory = results["tables"]["Tier memory during the pipeline run (bench/memory.py explains the columns)"]
    assert {row["tier"] for row in memory} >= {"grouping", "reward-worker", "rollout-worker"}


@pytest.mark.broker
def test_sizing_benchmark_runs(broker_env: dict[str, str], tmp_path: Path) -> None:
    results = run_bench("sizing", tmp_path, env=broker_env)
    [row] = next(iter(results["tables"].values()))
    assert row["case"] == "short-8" and row["prompts"] == 2 and row["CPU-s/M total"] > 0, row


@pytest.mark.broker
def test_reward_tier_benchmark_runs(broker_env: dict[str, str], tmp_path: Path) -> None:
    results = run_bench("reward", tmp_path, "--tier", "--rounds", "1", env=broker_env)
    rows = next(iter(results["tables"].values()))
    assert {row["mode"] for row in rows} == {"scoring", "floor"}
    # The quick run's 4 groups may cost less CPU than one /proc clock tick (10 ms): measured
    # (a number, never negative), not necessarily above zero. The wall time always is.
    assert all(row["CPU-ms per group"] >= 0 and row["wall s"] > 0 for row in rows), rows


@pytest.mark.broker
def test_latency_benchmark_runs(broker_env: dict[str, str], tmp_path: Path) -> None:
    run_bench("latency", tmp_path, env=broker_env)


@pytest.mark.broker
def test_trainer_benchmark_runs(broker_env: dict[str, str], tmp_path: Path) -> None:
    results = run_bench("trainer", tmp_path, "--ranks", "2", "--steps", "2", env=broker_env)
    row = next(iter(results["tables"].values()))[0]
    assert row["ranks"] == 2 and row["groups"] == 4 and row["p50"] >= 0


@pytest.mark.broker
def test_server_benchmark_runs_on_the_vllm_server(broker_env: dict[str, str], tmp_path: Path,
                                                  vllm_server: LocalVLLMServer) -> None:
    results = run_bench("server", tmp_path, "--server-url", vllm_server.url, "--model-path", vllm_server.model,
                        env=broker_env, timeout=300)
    rows = next(iter(results["tables"].values()))
    assert [row["path"] for row in rows] == ["directly", "through the pipeline"]
    assert all(0 < row["generated tokens"] <= 2 * 8 * 8 for row in rows), rows  # 2 groups of 8, at most 8 tokens each


def test_server_benchmark_refuses_clearly_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from bench import server

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    (tmp_path / "config.json").write_text("{}")
    assert server.main(["--engine", "hf", "--model-path", str(tmp_path)]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.broker
def test_weights_benchmark_runs_on_the_keep_server(redis_url: str, tmp_path: Path,
                                                    vllm_keep_server: LocalVLLMServer) -> None:
    results = run_bench("weights", tmp_path, "--server-url", vllm_keep_server.url, "--model-path",
                        vllm_keep_server.model, "--redis-url", redis_url, timeout=300)
    rows = next(iter(results["tables"].values()))
    assert [row["mode"] for row in rows] == ["no updates", "distributed, abort", "distributed, keep"]
    assert all(row["tokens/s"] > 0 for row in rows) and all(row["versions"] >= 1 for row in rows[1:]), rows
    assert rows[2]["re-prefilled / update"] == 0, rows  # keep prefills nothing again


@pytest.mark.broker
def test_elastic_benchmark_runs(broker_env: dict[str, str], tmp_path: Path) -> None:
    from bench.elastic import TRANSITIONS

    # phases of 3 s, workers fast enough to finish their prompts within a second of SIGTERM, the
    # crash noticed in 6 s (the broker's least session timeout): the whole schedule in half a minute
    results = run_bench("elastic", tmp_path, "--phase-seconds", "3", "--tokens-per-second", "8192",
                        "--failure-detection", "6", env=broker_env, timeout=240)
    rows = results["tables"]["Per transition (prompts re-run, duplicate tokens, unserved time)"]
    assert [row["transition"] for row in rows] == ["start", *TRANSITIONS]
    assert "dead worker's prompts in flight" in rows[-1] and "new worker: start -> first prompt (s)" in rows[1]
    assert results["extra"]["samples"] > 0 and results["extra"]["tokens"] > 0, results["extra"]
    assert {t["name"] for t in results["targets"]} >= {"duplicate tokens, % of the run"}


@pytest.mark.broker
def test_scale_out_benchmark_runs(broker_env: dict[str, str], tmp_path: Path) -> None:
    from bench.scale_out import capped_phases

    # at most 2 replicas a tier (6 tier processes, not 10), short phases, small groups
    results = run_bench("scale_out", tmp_path, "--max-replicas", "2", "--phase-seconds", "1", "--backlog", "8",
                        "--prompts", "2000", "--prompt-tokens", "16", "--completion-tokens", "32", "--timeout", "120",
                        env=broker_env, timeout=300)
    throughput, accounting = results["tables"].values()
    assert [row["phase"] for row in throughput] == [name for name, _ in capped_phases(2)]
    assert [row["rollout/reward/grouping"] for row in throughput] == ["1/1/1", "2/1/1", "2/2/1", "2/2/2", "1/1/1"]
    row = accounting[0]
    assert row["problems"] == "none" and row["lost"] == 0 and row["admitted"] > 0, row
    assert row["duplicate tasks"] == row["duplicate rows"] == 0 and row["replicas started"] == 6, row


def test_summary_tabulates_the_committed_results(capsys: pytest.CaptureFixture[str]) -> None:
    # the fresh results' headlines are checked above (check_tables); here the table itself
    assert summary.main() == 0
    out = capsys.readouterr().out
    assert out.startswith("| benchmark | figure | value | anchor / target |")
    committed = [name for name in summary.ORDER if (RESULTS_DIR / f"{name}.json").exists()]
    assert committed, "bench/results/ holds none of the benchmarks bench.summary tabulates"
    assert all(f"| {name} |" in out for name in committed), out

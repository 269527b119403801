"""The short chaos run: a minute of seeded faults on the 3-node cluster, 0 violations.

``bench.chaos`` (``python -m bench.chaos --quick``) in this process, on the module's cluster and
the tiny model: two producers, two rollout workers (up to four as they join), two reward
workers, two grouping instances and ``rollstream train`` as processes; a fault every 5.5 s or so
from ``ROLLSTREAM_CHAOS_SEED`` (each kind of fault once before any twice: the default seed plans 10 of
the 11, "redis restored from an earlier snapshot" third, and carries out those that begin within
the minute, 8 in the suite's runs). Every invariant of
``bench/chaos/invariants.py`` is checked while it runs and after the drain; the test fails on
any violation, naming each with what was seen. The 30-minute run's figures: bench/README.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bench.chaos.report import FOREIGN_ENV, report
from bench.chaos.run import Settings, run_chaos
from bench.common import Report
from harness.reports import ShowReport
from rollstream.dev.cluster import LocalKafkaCluster


pytestmark = [pytest.mark.broker, pytest.mark.slow]

SEED = int(os.environ.get("ROLLSTREAM_CHAOS_SEED", "20261201"))
MINUTES = 1.0  # with the cluster's start and the drain, about two minutes
MEAN_GAP = 5.5  # about 10 faults planned, each kind once before any twice


@pytest.mark.timeout(900)
async def test_a_short_chaos_run_breaks_no_invariant(
    kafka_cluster: LocalKafkaCluster, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], show_report: ShowReport,
) -> None:
    for name in [*FOREIGN_ENV, *(k for k in os.environ if k.startswith("ROLLSTREAM__"))]:
        monkeypatch.delenv(name, raising=False)  # the tiers inherit the environment, which wins over their config
    began = time.monotonic()
    result = await run_chaos(Settings(minutes=MINUTES, seed=SEED, mean_gap=MEAN_GAP), tmp_path, tiny_model,
                             cluster=kafka_cluster)
    report(result, Report("chaos", quick=True))
    print(f"short chaos run: {time.monotonic() - began:.0f}s wall")
    show_report(capsys.readouterr().out)  # the schedule, the faults as they began, the tables
    kinds = result.by_kind()
    text = "\n".join(f"[{v.invariant}] {v.saw}" for v in result.violations)
    assert not result.violations, f"{len(result.violations)} violations:\n{text}"
    assert len(result.done) >= 2 * MINUTES and len(kinds) >= 5, kinds
    assert result.figures["trainer steps"] > 0 and result.figures["batches checked"] > 0, result.figures
    assert set(result.figures["lags at the end"]) == {"rollout-worker", "reward-worker", "grouping"}

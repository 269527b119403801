"""AReaL's stats_tracker in a rollout worker: exported and reset into rollstream's tracker, so
it holds nothing between exports (rollstream/areal/stats.py; areal 1.0.4 installed)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from rollstream.areal.stats import export_areal_stats
from rollstream.runtime.stats import StatsTracker
from tests.reference_libs import import_reference

stats_tracker = import_reference("areal.utils.stats_tracker")


@pytest.fixture(autouse=True)
def fresh_stats() -> Iterator[None]:
    stats_tracker.export_all(reset=True)
    yield
    stats_tracker.export_all(reset=True)


def held() -> int:
    """Values AReaL's trackers hold now."""
    return sum(len(v) for t in stats_tracker.TRACKERS.values() for v in t.stats.values())


def test_areal_statistics_are_exported_reset_and_served_as_rollstreams() -> None:
    mine = StatsTracker()
    for reward in (1.0, 0.0, 1.0, 1.0):
        stats_tracker.get("rollout").scalar(reward=reward, seqlen=10)
    stats_tracker.denominator(mask=torch.tensor([True, False]))
    stats_tracker.stat(denominator="mask", lengths=torch.tensor([4.0, 9.0]))
    assert held() == 10
    assert export_areal_stats(mine) == 8  # reward, seqlen, their counts, mask, lengths/avg, /min, /max
    assert held() == 0  # AReaL's tracker is empty again
    sums, _ = mine.totals()
    assert sums["rollout/reward"] == (3.0, 4) and sums["rollout/seqlen"] == (40.0, 4)
    assert sums["lengths/avg"] == (4.0, 1) and sums["mask"] == (1.0, 1)  # reduced by AReaL: once per export
    stats_tracker.get("rollout").scalar(reward=0.0)
    export_areal_stats(mine)
    assert mine.totals()[0]["rollout/reward"] == (3.0, 5)  # totals since the start, as /metrics serves them
    assert export_areal_stats(mine) == 0  # nothing recorded since

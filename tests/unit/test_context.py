"""workflow_context: defaults, scoping, nesting, and isolation between concurrent episodes."""

from __future__ import annotations

import asyncio
import random

import pytest

from rollstream.api.context import workflow_context
from rollstream.runtime.stats import StatsTracker


def test_defaults_outside_any_episode() -> None:
    assert not workflow_context.in_episode()
    assert workflow_context.task_id == ""
    assert workflow_context.is_eval is False
    assert workflow_context.sample_idx == 0
    assert workflow_context.stat_scope() == "rollout"


def test_scope_sets_and_restores_also_on_error() -> None:
    with pytest.raises(RuntimeError):
        with workflow_context.scope(task_id="t1", is_eval=True, sample_idx=2):
            assert workflow_context.in_episode()
            assert (workflow_context.task_id, workflow_context.is_eval, workflow_context.sample_idx) == ("t1", True, 2)
            assert workflow_context.stat_scope() == "eval-rollout"
            raise RuntimeError
    assert not workflow_context.in_episode() and workflow_context.task_id == ""


def test_nested_scope_keeps_unspecified_values() -> None:
    with workflow_context.scope(task_id="outer", is_eval=True):
        with workflow_context.scope(sample_idx=5):
            assert workflow_context.get().task_id == "outer" and workflow_context.is_eval
            assert workflow_context.sample_idx == 5
        assert workflow_context.sample_idx == 0


async def _episode(task_id: str, is_eval: bool, seen: dict[str, tuple[str, bool, int]], idx: int) -> None:
    async def inner() -> None:
        for _ in range(5):
            await asyncio.sleep(random.random() / 1000)  # interleave with the other episodes
            seen[task_id] = (workflow_context.task_id, workflow_context.is_eval, workflow_context.sample_idx)
            assert workflow_context.task_id == task_id

    await workflow_context.run_in_context(inner(), task_id=task_id, is_eval=is_eval, sample_idx=idx)


async def test_concurrent_episodes_each_see_their_own_values() -> None:
    seen: dict[str, tuple[str, bool, int]] = {}
    await asyncio.gather(*(_episode(f"task-{i}", i % 2 == 1, seen, i) for i in range(50)))
    assert seen == {f"task-{i}": (f"task-{i}", i % 2 == 1, i) for i in range(50)}
    assert not workflow_context.in_episode()


async def test_run_in_context_returns_the_result() -> None:
    async def read() -> str:
        return workflow_context.task_id

    assert await workflow_context.run_in_context(read(), task_id="abc") == "abc"


async def test_stats_follow_the_episode_scope() -> None:
    tracker = StatsTracker()

    async def episode(is_eval: bool, value: float) -> None:
        with workflow_context.scope(task_id="t", is_eval=is_eval), tracker.scope("agent"):
            await asyncio.sleep(0)
            tracker.record(reward=value)
            tracker.increment("calls")

    await asyncio.gather(episode(False, 1.0), episode(False, 3.0), episode(True, 0.5))
    out = tracker.export()
    assert out["rollout/agent/reward/mean"] == 2.0
    assert out["rollout/agent/reward/min"] == 1.0 and out["rollout/agent/reward/max"] == 3.0
    assert out["rollout/agent/reward/count"] == 2.0
    assert out["eval-rollout/agent/reward/mean"] == 0.5
    assert out["rollout/agent/calls"] == 2.0 and out["eval-rollout/agent/calls"] == 1.0
    assert tracker.export() == {}


def test_stats_reject_non_numeric_and_keep_without_reset() -> None:
    tracker = StatsTracker()
    with pytest.raises(TypeError, match="'x' must be numeric"):
        tracker.record(x="high")
    tracker.record(x=True)
    assert tracker.export(reset=False) == tracker.export()
    with pytest.raises(ValueError):
        with tracker.scope("a/b"):
            pass


def test_totals_survive_export_for_the_metrics_endpoint() -> None:
    """``export`` resets what it reports; the totals the metrics endpoint serves only grow."""
    tracker = StatsTracker()
    tracker.record(reward=1.0)
    assert tracker.export()["rollout/reward/count"] == 1.0
    tracker.record(reward=0.5)
    tracker.increment("calls", 2)
    assert tracker.totals() == ({"rollout/reward": (1.5, 2)}, {"rollout/calls": 2})
    assert tracker.export()["rollout/reward/count"] == 1.0

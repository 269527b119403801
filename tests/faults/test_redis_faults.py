"""Redis faults are not crashes, and the staleness bound holds through a Redis that forgets.

1. The version key holds garbage for 30 s while the pipeline runs: no tier exits (the producer
   waits, the grouping tier keeps its last version, rollout workers keep theirs), and once the
   trainer publishes again everything ends exactly once.
2. Redis restarts WITHOUT persistence mid-run (every counter, marker and the version are gone):
   the producer rebuilds the budget from the topics before admitting again, so the staleness
   bound is never exceeded. Checked from the topics and the trainer's own publish log: when the
   n-th training prompt was committed at time t, ``n - drops(<= t) <= (eta + v(t) + 1) * B``
   with v(t) the trainer's version at t. (The prompt's commit comes after its admission, and
   versions and drops only grow, so a correct system passes; a budget zeroed by the restart
   admits a whole new budget at once and fails.)
"""

from __future__ import annotations

import bisect
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from harness.configs import pipeline_config
from harness.ledger import read_records
from harness.outcome_report import report
from harness.pipeline import Pipeline, write_dataset
from harness.reports import ShowReport
from rollstream.dev.redis_server import LocalRedisServer
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys
from rollstream.wire import GroupDropped, decode_group, decode_prompt


pytestmark = [pytest.mark.broker, pytest.mark.slow]

TIERS = {"producer": "producer", "rollout": "rollout-worker", "reward": "reward-worker", "grouping": "grouping"}


def start(pipeline: Pipeline) -> None:
    for name, tier in TIERS.items():
        pipeline.add(name, tier).start()


@pytest.mark.timeout(420)
async def test_a_garbage_version_key_for_30s_crashes_no_tier(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model: Path, tmp_path: Path,
    show_report: ShowReport,
) -> None:
    prompts = 64
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts)
    tree = pipeline_config(kafka_bootstrap, redis_url, unique_name, tiny_model, dataset, prompts)
    # a larger budget: many groups are in flight when the key goes bad, so every tier that reads
    # the version meets the garbage while it has work (the producer waits, the rest drain)
    tree["staleness"]["max_head_offpolicyness"] = 3
    tree["rollout"]["gconfig"]["max_new_tokens"] = 16  # slower samples: more of them in flight
    keys = RedisKeys(unique_name, "t0")
    async with Pipeline(tree, tmp_path, tiny_model, step_seconds=1.0) as pipeline:
        start(pipeline)
        client = aioredis.from_url(redis_url)
        budget = StalenessBudget(client, keys, 3, tree["staleness"]["groups_per_step"])
        try:
            in_flight = 0
            while in_flight < 8 or pipeline.version < 1:  # the key goes bad while groups are open
                await pipeline.sleep(0.1)
                in_flight = (await budget.usage())["admitted"] - len(pipeline.ledger.accounted)
            pipeline.hold_versions = True  # the trainer must not repair the key meanwhile
            await client.set(keys.key("version"), "garbage")
            at = pipeline.progress()
            await pipeline.sleep(30.0)
            during = pipeline.progress()
        finally:
            await client.aclose()
        pipeline.hold_versions = False  # the next publish repairs the key
        await pipeline.wait_for(pipeline.finished, 240, "every admitted prompt to end")
        outcome = await pipeline.outcome()
    noticed = {name: len(p.grep("not an integer")) for name, p in pipeline.tiers.items()}
    text = report("version key = 'garbage' for 30 s", outcome, {
        "progress": f"{at:.0%} when set ({in_flight} prompts in flight), {during:.0%} after 30 s",
        "log lines naming the malformed key, per tier": noticed,
    })
    show_report(text)
    assert not outcome.problems, "\n".join(outcome.problems) + "\n" + text
    assert outcome.admitted == prompts and not outcome.unexpected_exits, text
    assert noticed["producer"] > 0 and noticed["grouping"] > 0, text  # they saw it, and lived


@pytest.mark.timeout(420)
async def test_a_redis_restart_without_persistence_keeps_the_staleness_bound(
    kafka_bootstrap: str, unique_name: str, tiny_model: Path, tmp_path: Path, show_report: ShowReport,
) -> None:
    prompts = 96
    with LocalRedisServer(tmp_path / "redis", appendonly=False) as redis:
        dataset = write_dataset(tmp_path / "prompts.jsonl", prompts)
        tree = pipeline_config(kafka_bootstrap, redis.url, unique_name, tiny_model, dataset, prompts)
        eta, groups_per_step = tree["staleness"]["max_head_offpolicyness"], tree["staleness"]["groups_per_step"]
        async with Pipeline(tree, tmp_path, tiny_model, step_seconds=1.5) as pipeline:
            start(pipeline)
            await pipeline.wait_for(lambda: pipeline.progress() >= 0.4, 180, "40% ended")
            at = pipeline.progress()
            await pipeline.in_thread(redis.restart, 60, "the redis restart")
            await pipeline.wait_for(pipeline.finished, 300, "every admitted prompt to end")
            outcome = await pipeline.outcome()
            violations, worst = await admission_excess(pipeline, eta, groups_per_step)
    rebuilt = pipeline.tiers["producer"].grep("staleness budget rebuilt")
    text = report("redis restarted without persistence", outcome, {
        "restart at": f"{at:.0%}",
        "rebuilds": rebuilt[-1].split("] ")[-1] if rebuilt else "none",
        "admissions beyond (eta + v + 1) * B": f"{violations} (worst excess {worst})",
    })
    show_report(text)
    assert not outcome.problems, "\n".join(outcome.problems) + "\n" + text
    assert outcome.admitted == prompts and not outcome.unexpected_exits, text
    assert len(rebuilt) >= 2, text  # at the first start (empty topics) and after the restart
    assert violations == 0, text
    assert outcome.budget["admitted"] == prompts, text  # the rebuilt counter is exact


async def admission_excess(pipeline: Pipeline, eta: int, groups_per_step: int) -> tuple[int, int]:
    """How many training prompts were committed beyond the bound (see the module docstring),
    and the largest excess."""
    prompts = await timestamped(pipeline, pipeline.names.prompts, decode_prompt)
    train = sorted(ts for ts, task in prompts if not task.is_eval)
    drops = sorted(m.dropped_at for _, m in await timestamped(pipeline, pipeline.names.batches, decode_group)
                   if isinstance(m, GroupDropped) and not m.is_eval)
    times = [t for t, _ in pipeline.published_at]
    violations, worst = 0, 0
    for n, ts in enumerate(train, start=1):
        version = pipeline.published_at[bisect.bisect_right(times, ts) - 1][1]
        excess = n - bisect.bisect_right(drops, ts) - (eta + version + 1) * groups_per_step
        if excess > 0:
            violations += 1
            worst = max(worst, excess)
    return violations, worst


async def timestamped(pipeline: Pipeline, topic: str, decode) -> list[tuple[float, object]]:  # type: ignore[no-untyped-def]
    """(record timestamp in seconds, decoded value) of every committed record of ``topic``."""
    return [(r.timestamp / 1000, decode(r.value)) for r in await read_records(pipeline.config.kafka, topic)]

"""Exactly-once accounting under crashes, restarts and rebalances, tiers as separate processes.

Engine: the HF engine with the tiny offline model (hidden 32, 2 layers, max_new_tokens 4) and the
built-in RLVR workflow, so every episode is real generation with per-token logprobs and versions;
the reward worker scores with the default exact-match reward. A stand-in trainer publishes a new
weight version every ``staleness.groups_per_step`` emitted groups, so the producer is paced by the
staleness budget and lives through the whole run (and its kill lands mid-stream).

Redis: the test's own redis-server with ``appendonly`` (fsync always), so the version and the
staleness counters survive its restart. Without persistence a restart would zero the admitted
counter and the version: producers would then admit up to a whole new budget on top of the
prompts in flight (over-admission bounded by one budget), and the workers' version would appear to
go back (they ignore that and keep the last one). The accounting below would still hold, as it
reads only Kafka; the budget would not.

The invariant is read from the topics (read_committed): the task ids on ``prompts`` equal the
task ids of the groups in ``batch`` records plus those of ``dropped`` records, each exactly once,
and no ``(task_id, sample_idx)`` row repeats.
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.configs import pipeline_config
from harness.outcome_report import report
from harness.pipeline import Pipeline, write_dataset
from harness.reports import ShowReport
from rollstream.dev.launcher import DevStack
from rollstream.dev.redis_server import LocalRedisServer


pytestmark = [pytest.mark.broker, pytest.mark.slow]

PROMPTS = 100
SEED = int(os.environ.get("ROLLSTREAM_FAULT_SEED", "20261130"))
TIERS = {"producer": "producer", "rollout": "rollout-worker", "reward": "reward-worker", "grouping": "grouping"}


@dataclass(frozen=True)
class Fault:
    at: float  # fraction of the groups ended when it strikes
    kind: str  # "kill", "broker", "redis"
    target: str = ""
    jitter: float = 0.0  # seconds after reaching `at`
    down: float = 0.0  # seconds a killed tier stays down


def fault_schedule(rng: random.Random, with_broker: bool) -> list[Fault]:
    """Each tier killed once, two more kills of random tiers, one broker and one Redis restart."""
    def kill(target: str, low: float, high: float) -> Fault:
        return Fault(rng.uniform(low, high), "kill", target, rng.uniform(0, 1.5), rng.uniform(0, 2.0))

    # the producer ends once the budget lets it publish its last prompt (~84%): kill it before
    faults = [kill("producer", 0.03, 0.5)]
    faults += [kill(t, 0.03, 0.85) for t in ("rollout", "reward", "grouping")]
    faults += [kill(rng.choice(["rollout", "reward", "grouping"]), 0.1, 0.85) for _ in range(2)]
    faults.append(Fault(rng.uniform(0.15, 0.7), "redis", jitter=rng.uniform(0, 1.0)))
    if with_broker:
        faults.append(Fault(rng.uniform(0.15, 0.7), "broker", jitter=rng.uniform(0, 1.0)))
    return sorted(faults, key=lambda f: f.at)


async def start_pipeline(pipeline: Pipeline, grouping: int = 1) -> None:
    for name in ("rollout", "reward", "producer"):
        pipeline.add(name, TIERS[name])
    for i in range(grouping):
        pipeline.add(f"grouping-{i}", "grouping", f"grouping.instance_id=grouping-{i}")
    for process in pipeline.tiers.values():
        process.start()


@pytest.mark.timeout(480)
async def test_exactly_once_under_kills_and_restarts(
    kafka_bootstrap: str, dev_stack: DevStack, unique_name: str, tiny_model: Path, tmp_path: Path,
    show_report: ShowReport,
) -> None:
    broker = dev_stack.broker  # None with an external broker: no broker restart then
    rng = random.Random(SEED)
    schedule = fault_schedule(rng, with_broker=broker is not None)
    with LocalRedisServer(tmp_path / "redis", appendonly=True) as redis:
        dataset = write_dataset(tmp_path / "prompts.jsonl", PROMPTS)
        tree = pipeline_config(kafka_bootstrap, redis.url, unique_name, tiny_model, dataset, PROMPTS)
        async with Pipeline(tree, tmp_path, tiny_model) as pipeline:
            await start_pipeline(pipeline)
            done: list[str] = []
            for fault in schedule:
                await pipeline.wait_for(lambda f=fault: pipeline.progress() >= f.at, 240, f"{fault.at:.0%} ended")
                await pipeline.sleep(fault.jitter)
                done.append(f"{fault.kind} {fault.target} at {pipeline.progress():.0%}".replace("  ", " "))
                if fault.kind == "kill":
                    process = pipeline.tiers["grouping-0" if fault.target == "grouping" else fault.target]
                    if not process.running():
                        done[-1] += " (already finished: skipped)"
                        continue
                    process.kill()
                    await pipeline.sleep(fault.down)
                    process.start()
                elif fault.kind == "redis":
                    await pipeline.in_thread(redis.restart, 60, "the redis restart")
                else:
                    assert broker is not None
                    await pipeline.in_thread(broker.restart, 180, "the broker restart")
            await pipeline.wait_for(pipeline.finished, 300, "every admitted prompt to end")
            outcome = await pipeline.outcome()
        kills = sum(outcome.kills.values())
        text = report(f"exactly once under faults (seed {SEED})", outcome, {
            "faults": "; ".join(done),
            "restarts": f"broker {int(broker is not None)}, redis 1",
        })
        show_report(text)
    assert not outcome.problems, "\n".join(outcome.problems) + "\n" + text
    assert outcome.admitted == PROMPTS and outcome.emitted + sum(outcome.dropped.values()) == PROMPTS
    # admission is idempotent and survived the Redis restart: exactly one slot per admitted prompt
    assert outcome.budget["admitted"] == PROMPTS, text
    # every tier rode out the broker and Redis restarts (a tier started while the broker was down
    # waited for it): no process exited unless it was killed
    assert not outcome.unexpected_exits, text
    assert kills >= 5 and all(outcome.kills[n] >= 1 for n in ("producer", "rollout", "reward", "grouping-0")), text


@pytest.mark.timeout(300)
async def test_grouping_scaled_out_and_back_mid_run(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model: Path, tmp_path: Path,
    show_report: ShowReport,
) -> None:
    """One grouping instance, then two (each takes a partition), then one again: exactly once."""
    prompts = 60
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts)
    tree = pipeline_config(kafka_bootstrap, redis_url, unique_name, tiny_model, dataset, prompts)
    async with Pipeline(tree, tmp_path, tiny_model, step_seconds=1.0) as pipeline:
        await start_pipeline(pipeline)
        await pipeline.wait_for(lambda: pipeline.progress() >= 0.2, 180, "20% ended")
        pipeline.hold_versions = True  # no new prompts until the second instance is in
        second = pipeline.add("grouping-1", "grouping", "grouping.instance_id=grouping-1")
        second.start()
        await pipeline.wait_for(lambda: bool(second.grep("assigned partitions [")), 120,
                                "the second grouping instance to own a partition")
        at_scale_out = pipeline.progress()
        pipeline.hold_versions = False
        await pipeline.wait_for(lambda: len(second.grep(": emitted group ")) >= 6, 180,
                                "groups emitted by the second instance")
        at_scale_in = pipeline.progress()
        assert await asyncio.to_thread(second.stop, 60.0) == 0, second.tail()
        await pipeline.wait_for(pipeline.finished, 240, "every admitted prompt to end")
        outcome = await pipeline.outcome()
    first_assignments = pipeline.tiers["grouping-0"].grep("assigned partitions")
    second_emitted = len(second.grep(": emitted group "))
    text = report("grouping scaled 1 -> 2 -> 1", outcome, {
        "scaled out at": f"{at_scale_out:.0%}", "scaled in at": f"{at_scale_in:.0%}",
        "groups emitted by the second instance": second_emitted,
        "assignments seen by the first instance": len(first_assignments),
    })
    show_report(text)
    assert not outcome.problems, "\n".join(outcome.problems) + "\n" + text
    assert outcome.admitted == prompts and outcome.emitted + sum(outcome.dropped.values()) == prompts
    assert not outcome.unexpected_exits, text
    assert second_emitted > 0 and len(first_assignments) >= 3, text

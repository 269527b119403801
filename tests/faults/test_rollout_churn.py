"""An elastic rollout fleet under weight updates: workers join, leave, restart and crash.

Three rollout workers (their own processes, the HF engine on the tiny model, 32 new tokens a
sample so that every change lands mid-generation), a stand-in trainer publishing a version
every ``staleness.groups_per_step`` groups, and each fleet change made right after a publish, while
the workers reload weights: a worker joins, one leaves (SIGTERM), one restarts with the same
``rollout.worker_id``, one crashes (SIGKILL). The accounting holds (every admitted prompt ends
as one group or one counted drop, no group twice), and a prompt is generated a second time
only when it was running on the worker that crashed.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from pathlib import Path

import pytest

from harness.configs import pipeline_config
from harness.full_length import FULL_LENGTH_RLVR
from harness.outcome_report import report
from harness.pipeline import Pipeline, write_dataset
from harness.reports import ShowReport
from harness.tiers import TierProcess


pytestmark = [pytest.mark.broker, pytest.mark.slow]

STARTED = re.compile(r"task (\S+): running \d+ samples with workflow")
FINISHED = re.compile(r"task (\S+): all \d+ samples published")
GONE = re.compile(r"worker (\S+) that ran it is gone")


def started_tasks(process: TierProcess) -> list[str]:
    return [m.group(1) for line in process.grep("samples with workflow") if (m := STARTED.search(line))]


def in_flight(process: TierProcess) -> set[str]:
    """Prompts the process started and did not finish (its whole log: read it after the kill)."""
    finished = {m.group(1) for line in process.grep("samples published") if (m := FINISHED.search(line))}
    return set(started_tasks(process)) - finished


async def after_a_publish(pipeline: Pipeline, progress: float) -> None:
    """Wait until ``progress`` of the groups ended, then for the next version publish (the
    workers are loading it)."""
    await pipeline.wait_for(lambda: pipeline.progress() >= progress, 240, f"{progress:.0%} ended")
    version = pipeline.version
    await pipeline.wait_for(lambda: pipeline.version > version, 60, "a version publish")


@pytest.mark.timeout(480)
async def test_workers_join_leave_restart_and_crash_during_weight_updates(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model: Path, tmp_path: Path,
    show_report: ShowReport,
) -> None:
    prompts = 96
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts)
    tree = pipeline_config(kafka_bootstrap, redis_url, unique_name, tiny_model, dataset, prompts)
    tree["kafka"]["partitions"] = 4  # three workers, each with a partition
    # long samples, few at a time, and a trainer that takes 3 s a step: the run lasts about a
    # minute and a half, so every fleet change lands while prompts are being generated
    tree["rollout"].update({"gconfig": {"max_new_tokens": 32}, "workflows": FULL_LENGTH_RLVR, "max_concurrent_rollouts": 8,
                            "failure_detection_seconds": 6, "shutdown_grace_seconds": 120})
    async with Pipeline(tree, tmp_path, tiny_model, step_seconds=3.0) as pipeline:
        for name, tier in (("reward", "reward-worker"), ("grouping", "grouping"), ("producer", "producer")):
            pipeline.add(name, tier).start()
        workers = [pipeline.add(f"rollout-{i}", "rollout-worker", f"rollout.worker_id=rollout-{i}") for i in range(3)]
        workers[0].start()
        workers[1].start()
        done: list[str] = []
        await after_a_publish(pipeline, 0.1)
        workers[2].start()
        done.append(f"join at {pipeline.progress():.0%}")
        await after_a_publish(pipeline, 0.3)
        done.append(f"leave at {pipeline.progress():.0%}")
        assert await asyncio.to_thread(workers[0].stop, 150.0) == 0, workers[0].tail()
        await after_a_publish(pipeline, 0.45)
        done.append(f"restart at {pipeline.progress():.0%}")
        assert await asyncio.to_thread(workers[1].stop, 150.0) == 0, workers[1].tail()
        workers[1].start()
        await after_a_publish(pipeline, 0.6)
        done.append(f"crash at {pipeline.progress():.0%}")
        workers[2].kill()
        crashed_in_flight = in_flight(workers[2])
        await pipeline.wait_for(pipeline.finished, 300, "every admitted prompt to end")
        outcome = await pipeline.outcome()
    starts = Counter(task for worker in workers for task in started_tasks(worker))
    again = {task: n - 1 for task, n in starts.items() if n > 1}
    taken_over = [line for w in workers for line in w.grep("running it again")]
    text = report("rollout workers join, leave, restart, crash during weight updates", outcome, {
        "fleet changes": "; ".join(done),
        "prompts started more than once": dict(again) or "none",
        "the crashed worker's prompts in flight": sorted(crashed_in_flight),
        "claims taken over": len(taken_over),
    })
    show_report(text)
    assert not outcome.problems, "\n".join(outcome.problems) + "\n" + text
    assert outcome.admitted == prompts and outcome.emitted + sum(outcome.dropped.values()) == prompts, text
    assert not outcome.unexpected_exits, text
    # Only the crash re-runs prompts, each once: the ones it had in flight, and the ones it
    # finished whose done mark or offset commit had not landed yet (at least once; grouping drops
    # the repeated samples). Every re-run is a claim taken over from the crashed worker.
    assert all(n == 1 for n in again.values()) and set(again) <= set(started_tasks(workers[2])), text
    assert {gone.group(1) for line in taken_over if (gone := GONE.search(line))} <= {"rollout-2"}, taken_over
    assert len(taken_over) == len(again), text

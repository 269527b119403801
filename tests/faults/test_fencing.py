"""Exactly once when instances are PAUSED past their session timeout, not only killed.

A paused instance (SIGSTOP: a GC pause, a stalled VM, a network partition look the same) loses
its partitions to another instance while it still holds fetched records, and may wake up in the
middle of a transaction. aiokafka has no KIP-447, so the broker cannot fence it by consumer
generation; rollstream fences by transactional id per input partition (docs/GUARANTEES.md,
"Fencing"). This test runs two instances of every transactional tier (producers with their own
ids, reward workers, grouping instances), pauses instances past the session timeout several
times while the pipeline runs, SIGKILLs others, and checks from the topics (read_committed)
that every admitted prompt ended exactly once, and from a real ``StepStream`` trainer that it
trained on no group twice.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter
from pathlib import Path

import pytest

from harness.configs import pipeline_config
from harness.outcome_report import report
from harness.pipeline import Pipeline, write_dataset
from harness.reports import ShowReport
from rollstream.trainer import StepStream
from rollstream.config import config_from_dict


pytestmark = [pytest.mark.broker, pytest.mark.slow]

PROMPTS = 96
SESSION_MS = 6000
PAUSE_SECONDS = 11.0  # past the 6 s session timeout: the group moves the partitions away
SEED = int(os.environ.get("ROLLSTREAM_FAULT_SEED", "20261130"))


class Trainer:
    """A trainer on the public API: reads steps of groups, records what it trained, acks."""

    def __init__(self, tree: dict, name: str) -> None:
        config = config_from_dict({**tree, "staleness": {**tree["staleness"], "groups_per_step": 4}, "trainer": {"group_id": f"{name}-trainer"}})
        self.consumer = StepStream(config, ledger=False, client_id="fault-trainer")
        self.trained: Counter[str] = Counter()
        self.steps = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Trainer:
        await self.consumer.start()
        self._task = asyncio.create_task(self._run(), name="fault-trainer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.close()

    async def _run(self) -> None:
        while True:
            batch = await self.consumer.next_step(timeout=0.5)
            if batch is None:
                continue
            self.trained.update(batch.task_ids)
            self.steps += 1
            await self.consumer.ack(batch)


@pytest.mark.timeout(600)
async def test_paused_instances_are_fenced_and_nothing_is_emitted_or_trained_twice(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model: Path, tmp_path: Path,
    show_report: ShowReport,
) -> None:
    rng = random.Random(SEED)
    dataset = write_dataset(tmp_path / "prompts.jsonl", PROMPTS)
    tree = pipeline_config(kafka_bootstrap, redis_url, unique_name, tiny_model, dataset, PROMPTS)
    tree["reward"]["session_timeout_ms"] = tree["grouping"]["session_timeout_ms"] = SESSION_MS
    half = PROMPTS // 2
    # the trainer paces admission (a version step takes >= 5 s, 8 prompts each), so the run
    # lasts longer than the faults and each one strikes while work is flowing
    async with Pipeline(tree, tmp_path, tiny_model, step_seconds=5.0) as pipeline, \
            Trainer(tree, unique_name) as trainer:
        for i in range(2):
            pipeline.add(f"producer-{i}", "producer", f"producer.producer_id=producer-{i}", f"producer.max_prompts={half}")
            pipeline.add(f"reward-{i}", "reward-worker", f"reward.worker_id=reward-{i}")
            pipeline.add(f"grouping-{i}", "grouping", f"grouping.instance_id=grouping-{i}")
        pipeline.add("rollout", "rollout-worker")
        for process in pipeline.tiers.values():
            process.start()
        faults: list[str] = []
        # pauses of each transactional tier's instances, and kills of others in between
        plan = [(0.05, "pause", "grouping-0"), (0.12, "kill", "producer-1"), (0.2, "pause", "reward-0"),
                (0.3, "kill", "reward-1"), (0.4, "pause", "grouping-1"), (0.5, "kill", "grouping-0"),
                (0.6, "pause", "reward-1")]
        paused_mid_run = 0
        for at, kind, name in plan:
            await pipeline.wait_for(lambda a=at: pipeline.progress() >= a, 240, f"{at:.0%} ended")
            await pipeline.sleep(rng.uniform(0, 1.0))
            process = pipeline.tiers[name]
            if not process.running():
                faults.append(f"{kind} {name}: not running, skipped")
                continue
            faults.append(f"{kind} {name} at {pipeline.progress():.0%}")
            if kind == "pause":
                paused_mid_run += pipeline.progress() < 0.95
                process.pause()
                await pipeline.sleep(PAUSE_SECONDS)
                process.resume()
            else:
                process.kill()
                await pipeline.sleep(rng.uniform(0.5, 2.0))
                process.start()
        await pipeline.wait_for(pipeline.finished, 300, "every admitted prompt to end")
        outcome = await pipeline.outcome()
        await pipeline.sleep(3.0)  # the trainer takes the last full steps
        trained, skipped = trainer.trained, trainer.consumer.duplicates_skipped
    fenced = {name: len(p.grep("owned by another instance now")) for name, p in pipeline.tiers.items()}
    text = report(f"paused and killed instances (seed {SEED})", outcome, {
        "faults": "; ".join(faults),
        "fenced partitions (commits refused after a pause)": {k: v for k, v in fenced.items() if v} or "none",
        "trainer": f"{trainer.steps} steps, {sum(trained.values())} groups, duplicates skipped {skipped}",
    })
    show_report(text)
    assert not outcome.problems, "\n".join(outcome.problems) + "\n" + text
    assert outcome.admitted == PROMPTS and outcome.emitted + sum(outcome.dropped.values()) == PROMPTS, text
    assert not outcome.unexpected_exits, text
    assert paused_mid_run >= 3, text  # the pauses struck while work was flowing
    twice = [task for task, n in trained.items() if n > 1]
    assert not twice and skipped == 0, f"trained twice: {twice}\n{text}"
    assert set(trained) <= set(pipeline.ledger.emitted) and len(trained) >= outcome.emitted - 4, text

"""torchrun trainers (gloo, CPU) over a live pipeline: shares, lockstep, one commit per step, and
ranks lost mid-step.

The pipeline (producer, rollout worker with the tiny offline model, reward worker, grouping) runs
as separate processes; two trainer jobs read its ``batches`` at the same time, each in its own
consumer group, started as ``rollstream train`` starts a trainer (torchrun with restarts,
harness/trainer_jobs.py): a 2-rank job whose rank 1 is SIGKILLed in step 2 and, in
the restarted run, SIGSTOPped in step 3 (found by the heartbeats within
``trainer.rank_timeout_seconds`` and ended), and a 3-rank job whose Kafka-owning rank 0 is
SIGKILLed in step 2. The jobs recover by themselves. Asserted from the topic, the trainers' consumer groups'
committed offsets, the trainers' ledgers and every rank's own log: every group emitted is in
exactly one committed step (0 lost, 0 trained twice), every rank trained its share of every
step, the ranks stepped in lockstep, each step was committed once, and each loss is one line in
the survivors' logs naming the rank, its step and phase, the restart and where the job resumes.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka.structs import TopicPartition

from harness.configs import pipeline_config
from harness.pipeline import Pipeline, write_dataset
from harness.tiny_models import build_model
from harness.trainer_jobs import TrainerJob, pid_gone
from rollstream.kafka.clients import make_consumer
from rollstream.kafka.scan import scan_topic
from rollstream.trainer import LedgerEntry, StepLedger


pytestmark = [pytest.mark.broker, pytest.mark.slow]

PROMPTS = 24
GROUPS_PER_STEP = 6  # a whole number of groups for 2 and for 3 ranks
STEPS = PROMPTS // GROUPS_PER_STEP
RANK_TIMEOUT = 5.0
TIERS = {"rollout": "rollout-worker", "reward": "reward-worker", "grouping": "grouping", "producer": "producer"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory)


def kafka_job(name: str, ranks: int, tree: dict[str, Any], workdir: Path, max_restarts: int) -> TrainerJob:
    """A trainer job in its own consumer group, with its own ledger."""
    ledger = workdir / name / "ledger.jsonl"
    trainer = {"group_id": f"{tree['experiment']['experiment_name']}-{name}",
               "ledger_path": str(ledger), "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000,
               "poll_timeout_ms": 200, "rank_timeout_seconds": RANK_TIMEOUT,
               # two jobs read one stream whose versions the pipeline's stand-in trainer publishes:
               # Redis's version is not what these jobs train, so it cannot tell them what is stale
               "drop_stale": False}
    staleness = {**tree.get("staleness", {}), "groups_per_step": GROUPS_PER_STEP}
    return TrainerJob(name, ranks, {**tree, "staleness": staleness, "trainer": trainer}, workdir, steps=STEPS, max_restarts=max_restarts,
                      job_args=["--step-seconds", "1.5"])


def ledger_of(job: TrainerJob) -> StepLedger:
    return StepLedger(job.out / "ledger.jsonl")


async def committed_and_last(pipe: Pipeline, group_id: str) -> tuple[dict[int, int | None], dict[int, int]]:
    """The consumer group's committed offsets, and per partition the offset after its last record (the
    topic's end is past that: transaction markers take offsets too)."""
    last: dict[int, int] = {}
    async for record in scan_topic(pipe.config.kafka, pipe.names.batches, "test-scan"):
        last[record.partition] = max(last.get(record.partition, 0), record.offset + 1)
    consumer = make_consumer(pipe.config.kafka, "test-offsets", group_id=group_id)
    await consumer.start()
    try:
        committed = {p: await consumer.committed(TopicPartition(pipe.names.batches, p)) for p in sorted(last)}
    finally:
        await consumer.stop()
    return committed, last


def resumes(entries: list[LedgerEntry], step: int) -> str:
    """How the log says where the job resumes after ``step``."""
    offsets: dict[int, int] = {}
    for entry in entries:
        if entry.step <= step:
            offsets.update(entry.offsets)
    return f"the job resumes after step {step} (committed offsets {{{', '.join(f'{p}: {o}' for p, o in sorted(offsets.items()))}}})"


def one_line(job: TrainerJob, rank: int, run: int, *parts: str) -> str:
    found = [line for line in job.log_text(rank).splitlines()
             if f"[rank {rank}, restart {run}]" in line and all(p in line for p in parts)]
    assert len(found) == 1, (job.name, rank, run, parts, job.log_text(rank)[-3000:])
    return found[0]


def check_job(job: TrainerJob, emitted: list[str], faults: list[tuple[int, int, int, int]]) -> str:
    """Every assertion on one finished job (``faults``: rank, step, run, pid of each loss);
    returns its summary line."""
    entries = ledger_of(job).read()
    assert [e.step for e in entries] == list(range(1, STEPS + 1)), "each step committed once, in order"
    trained = [t for e in entries for t in e.task_ids]
    assert len(trained) == len(set(trained)), f"trained twice: {sorted(t for t in set(trained) if trained.count(t) > 1)}"
    assert sorted(trained) == sorted(emitted), f"lost: {sorted(set(emitted) - set(trained))}"
    for e in entries:
        assert len(e.ranks) == job.ranks and all(e.ranks), f"step {e.step}: a rank without groups {e.ranks}"
        assert sorted(t for share in e.ranks for t in share) == sorted(e.task_ids)
    logs = [job.events(r) for r in range(job.ranks)]
    for lost, step, run, pid in faults:
        # the next run resumed after the step before, on every rank; the lost rank died inside the step
        assert all({e["last"] for e in log if e["event"] == "resume" and e["restart"] == run + 1} == {step - 1} for log in logs)
        assert any(e["event"] == "start" and e["step"] == step and e["restart"] == run for e in logs[lost])
        assert not any(e["event"] == "commit" and e["step"] == step and e["restart"] == run for log in logs for e in log)
        # the survivors that watch it (rank 0 watches everyone, the others rank 0) said so in one line each
        for rank in (range(1, job.ranks) if lost == 0 else [0]):
            line = one_line(job, rank, run, f"rank {lost} (pid {pid} on")
            assert f"in step {step}, phase 'train'" in line, line
            assert f"restart {run + 1} of at most {job.max_restarts}" in line and resumes(entries, step - 1) in line, line
    for entry in entries:  # every rank trained exactly its share of each committed step
        for rank, log in enumerate(logs):
            started = [e for e in log if e["event"] == "start" and e["step"] == entry.step and e["restart"] == entry.restart]
            assert len(started) == 1 and started[0]["tasks"] == entry.ranks[rank], (entry.step, rank, started)
            assert started[0]["world"] == job.ranks
    for run in range(len(faults) + 1):  # lockstep: within each run, every rank started and committed the same steps
        for event in ("start", "commit"):
            steps = {tuple(e["step"] for e in log if e["event"] == event and e["restart"] == run) for log in logs}
            if event == "commit" or run == len(faults):
                assert len(steps) == 1, (job.name, run, event, steps)
    for rank in range(job.ranks):  # one line per loss: no tracebacks, no "finishing" a step that cannot finish
        assert "Traceback" not in job.log_text(rank) and "finishing" not in job.log_text(rank)
    assert "Traceback" not in (job.out / "torchrun.log").read_text(errors="replace")  # nor on the ranks' stderr
    per_rank = [sum(len(e.ranks[r]) for e in entries) for r in range(job.ranks)]
    return f"{job.name}: {len(entries)} steps, {len(trained)} groups, groups per rank {per_rank}, restarts {entries[-1].restart}"


@pytest.mark.timeout(480)
async def test_torchrun_trainers_share_steps_and_recover_from_lost_ranks(
    tiny_model: Path, kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path,
) -> None:
    tree = pipeline_config(kafka_bootstrap, redis_url, unique_name, tiny_model,
                           write_dataset(tmp_path / "prompts.jsonl", PROMPTS), PROMPTS)
    two, three = kafka_job("two", 2, tree, tmp_path, max_restarts=2), kafka_job("three", 3, tree, tmp_path, max_restarts=1)
    faults: dict[str, list[tuple[int, int, int, int]]] = {}
    async with Pipeline(tree, tmp_path, tiny_model, step_seconds=0.5) as pipe:
        try:
            for name, tier in TIERS.items():
                pipe.add(name, tier).start()
            for job in (two, three):
                job.start()

            async def hurt_two() -> float:
                dead = await two.hurt(1, 2, 0, signal.SIGKILL, 240, pipe.supervise)
                stalled = await two.hurt(1, 3, 1, signal.SIGSTOP, 240, pipe.supervise)
                stopped_at = time.monotonic()
                faults["two"] = [(1, 2, 0, dead), (1, 3, 1, stalled)]
                await pipe.wait_for(lambda: pid_gone(stalled), RANK_TIMEOUT + 30, "the stopped rank to be ended")
                return time.monotonic() - stopped_at

            async def hurt_three() -> None:
                dead = await three.hurt(0, 2, 0, signal.SIGKILL, 240, pipe.supervise)
                faults["three"] = [(0, 2, 0, dead)]

            ended_after, _ = await asyncio.gather(hurt_two(), hurt_three())
            codes = await asyncio.gather(*(job.wait(300, pipe.supervise) for job in (two, three)))
            for job, code in zip((two, three), codes):
                assert code == 0, f"{job.name}:\n{job.tail()}"
            await pipe.wait_for(pipe.finished, 60, "the pipeline to account for every prompt")
            outcome = await pipe.outcome()
            assert not outcome.problems, outcome.problems
            emitted = sorted(pipe.ledger.emitted)
            lines = []
            for job in (two, three):
                lines.append(check_job(job, emitted, faults[job.name]))
                committed, last = await committed_and_last(pipe, job.config_tree["trainer"]["group_id"])
                assert committed == last, f"{job.name}: committed {committed}, records end at {last}"
            one_line(two, 0, 1, "ended rank 1 (pid")
            assert ended_after < RANK_TIMEOUT + 15, ended_after
            print("\n" + "\n".join(lines) + f"\nstalled rank ended {ended_after:.1f} s after its SIGSTOP")
        finally:
            for job in (two, three):
                job.stop()

"""torchrun trainers (gloo, CPU) over a live pipeline: shares, lockstep, one commit per step, and
a rank SIGKILLed mid-step.

The pipeline (producer, rollout worker with the tiny offline model, reward worker, grouping) runs
as separate processes; two trainer jobs read its ``batches`` at the same time, each in its own
consumer group: a 2-rank and a 3-rank ``torchrun`` job of tests/integration/trainer_job.py
(``--max-restarts 1``). In each, one rank is SIGKILLed in the middle of step 2 (a follower in
the 2-rank job, the Kafka-owning rank 0 in the 3-rank one); torchrun restarts the job, which
resumes after step 1. Asserted from the topic, the trainer group's committed offsets, the
trainers' ledgers and every rank's own log: every group emitted is in exactly one committed
step (0 lost, 0 trained twice), every rank trained its share of every step, the ranks stepped
in lockstep, and each step was committed once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiokafka.structs import TopicPartition

from rollstream.kafka.clients import make_consumer
from rollstream.kafka.scan import scan_topic
from rollstream.trainer import StepLedger
from tests.faults.conftest import build_model
from bench.harness.pipeline import Pipeline, pipeline_config, write_dataset

pytestmark = [pytest.mark.broker, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 24
BATCH = 6  # groups per step: a whole number of groups for 2 and for 3 ranks
STEPS = PROMPTS // BATCH
TIERS = {"rollout": "rollout-worker", "reward": "reward-worker", "grouping": "grouping", "producer": "producer"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory)


class TrainerJob:
    """One ``torchrun`` job of trainer_job.py in its own consumer group, with its own ledger."""

    def __init__(self, name: str, ranks: int, tree: dict[str, Any], workdir: Path, step_seconds: float) -> None:
        self.name, self.ranks = name, ranks
        self.out = workdir / name
        self.out.mkdir()
        self.ledger = StepLedger(self.out / "ledger.jsonl")
        trainer = {"batch_size": BATCH, "group_id": f"{tree['experiment']['experiment_name']}-{name}",
                   "ledger_path": str(self.ledger.path), "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000,
                   "poll_timeout_ms": 200}
        self.config = self.out / "config.yaml"
        self.config.write_text(yaml.safe_dump({**tree, "trainer": trainer}))
        self.group_id = trainer["group_id"]
        self.step_seconds = step_seconds
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.ranks}",
                "--max-restarts=1", "--monitor-interval=0.5", str(REPO / "tests/integration/trainer_job.py"),
                "--config", str(self.config), "--out", str(self.out), "--steps", str(STEPS),
                "--step-seconds", str(self.step_seconds)]
        # torchrun's restarts otherwise reuse rendezvous keys of the failed run (pytorch#135712)
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        with (self.out / "torchrun.log").open("ab") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def log(self, rank: int) -> list[dict[str, Any]]:
        path = self.out / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def in_step(self, rank: int, step: int) -> int | None:
        """The pid of ``rank`` while it is inside ``step`` of the first run (started, not committed)."""
        events = [e for e in self.log(rank) if e["restart"] == 0 and e.get("step") == step]
        if [e["event"] for e in events] == ["start"]:
            return int(events[0]["pid"])
        return None

    def tail(self) -> str:
        return "\n".join((self.out / "torchrun.log").read_text(errors="replace").splitlines()[-40:])

    def stop(self) -> None:
        """Kill torchrun and every worker it started (they run in sessions of their own)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in {e["pid"] for r in range(self.ranks) for e in self.log(r)}:
            with contextlib.suppress(OSError):  # gone already; and a reused pid is not ours
                if "trainer_job.py" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.kill(pid, signal.SIGKILL)


async def kill_mid_step(pipe: Pipeline, job: TrainerJob, rank: int, step: int, timeout: float) -> int:
    """SIGKILL ``rank`` of ``job`` once it is inside ``step``; returns its pid."""
    deadline = time.monotonic() + timeout
    while (pid := job.in_step(rank, step)) is None:
        pipe.supervise()
        assert job.proc is not None and job.proc.poll() is None, f"{job.name} ended early\n{job.tail()}"
        assert time.monotonic() < deadline, f"{job.name} rank {rank} never reached step {step}\n{job.tail()}"
        await asyncio.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return pid


async def committed_and_last(pipe: Pipeline, group_id: str) -> tuple[dict[int, int | None], dict[int, int]]:
    """The group's committed offsets, and per partition the offset after its last record (the
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


def check_job(job: TrainerJob, emitted: list[str], killed_rank: int) -> str:
    """Every assertion on one finished job; returns its summary line."""
    entries = job.ledger.read()
    assert [e.step for e in entries] == list(range(1, STEPS + 1)), "each step committed once, in order"
    trained = [t for e in entries for t in e.task_ids]
    assert len(trained) == len(set(trained)), f"trained twice: {sorted(t for t in set(trained) if trained.count(t) > 1)}"
    assert sorted(trained) == sorted(emitted), f"lost: {sorted(set(emitted) - set(trained))}"
    for e in entries:
        assert len(e.ranks) == job.ranks and all(e.ranks), f"step {e.step}: a rank without groups {e.ranks}"
        assert sorted(t for share in e.ranks for t in share) == sorted(e.task_ids)
    logs = [job.log(r) for r in range(job.ranks)]
    # the restart resumed after step 1 on every rank, and the killed rank died inside step 2
    assert all({e["last"] for e in log if e["event"] == "resume" and e["restart"] == 1} == {1} for log in logs)
    assert any(e["event"] == "start" and e["step"] == 2 and e["restart"] == 0 for e in logs[killed_rank])
    assert not any(e["event"] == "commit" and e["step"] == 2 and e["restart"] == 0 for log in logs for e in log)
    for entry in entries:  # every rank trained exactly its share of each committed step
        for rank, log in enumerate(logs):
            started = [e for e in log if e["event"] == "start" and e["step"] == entry.step and e["restart"] == entry.restart]
            assert len(started) == 1 and started[0]["tasks"] == entry.ranks[rank], (entry.step, rank, started)
            assert started[0]["world"] == job.ranks
    for restart in (0, 1):  # lockstep: within each run, every rank started and committed the same steps
        for event in ("start", "commit"):
            steps = {tuple(e["step"] for e in log if e["event"] == event and e["restart"] == restart) for log in logs}
            if event == "commit" or restart == 1:
                assert len(steps) == 1, (job.name, restart, event, steps)
    per_rank = [sum(len(e.ranks[r]) for e in entries) for r in range(job.ranks)]
    return f"{job.name}: {len(entries)} steps, {len(trained)} groups, groups per rank {per_rank}, restarts {entries[-1].restart}"


@pytest.mark.timeout(420)
async def test_torchrun_trainers_share_steps_and_survive_a_killed_rank(
    tiny_model: Path, kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path,
) -> None:
    tree = pipeline_config(kafka_bootstrap, redis_url, unique_name, tiny_model,
                           write_dataset(tmp_path / "prompts.jsonl", PROMPTS), PROMPTS)
    jobs = [TrainerJob("two", 2, tree, tmp_path, step_seconds=1.5), TrainerJob("three", 3, tree, tmp_path, step_seconds=1.5)]
    killed = {"two": 1, "three": 0}  # a follower; the rank that owns the Kafka consumer
    async with Pipeline(tree, tmp_path, tiny_model, step_seconds=0.5) as pipe:
        try:
            for name, tier in TIERS.items():
                pipe.add(name, tier).start()
            for job in jobs:
                job.start()
            await asyncio.gather(*(kill_mid_step(pipe, job, killed[job.name], 2, 240) for job in jobs))
            await pipe.wait_for(lambda: all(j.proc is not None and j.proc.poll() is not None for j in jobs), 240,
                                "both trainer jobs to finish")
            for job in jobs:
                assert job.proc is not None and job.proc.returncode == 0, f"{job.name}:\n{job.tail()}"
            await pipe.wait_for(pipe.finished, 60, "the pipeline to account for every prompt")
            outcome = await pipe.outcome()
            assert not outcome.problems, outcome.problems
            emitted = sorted(pipe.ledger.emitted)
            lines = []
            for job in jobs:
                lines.append(check_job(job, emitted, killed[job.name]))
                committed, last = await committed_and_last(pipe, job.group_id)
                assert committed == last, f"{job.name}: committed {committed}, records end at {last}"
            print("\n" + "\n".join(lines))
        finally:
            for job in jobs:
                job.stop()

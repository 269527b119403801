"""TrainerSteps across real ranks (torch.distributed, gloo on CPU), fed by an in-memory source.

Every rank gets its share of each step, the ranks step in lockstep, a step is committed once
after every rank called commit, a stop on one rank ends every rank's loop, and a failure on
rank 0 reaches every rank instead of hanging them. A ``torchrun`` job (file-backed steps, no
broker) recovers from a dead, a stalled and a failed rank, each named in the survivors' logs.
(The live Kafka path under ``torchrun`` is tests/integration/test_trainer_torchrun.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.configs import make_config
from harness.trainer_jobs import TrainerJob, pid_gone
from rollstream.trainer import RankFailed, TrainerSteps
from rollstream.trainer.accumulator import StepAccumulator
from rollstream.trainer.training_step import GroupRows
from rollstream.trainer.ledger import LedgerEntry
from rollstream.trainer.step_source import Step


GROUPS = 12
STEP_GROUPS = 4


def group(i: int) -> GroupRows:
    length = 3 + (7 * i) % 11  # unequal groups, so the token balance matters
    tensors = {
        "input_ids": torch.full((2, length), i, dtype=torch.int32),
        "attention_mask": torch.ones((2, length), dtype=torch.bool),
        "rewards": torch.tensor([float(i), 0.0]),
    }
    return GroupRows(f"task-{i}", 2, False, 0, tensors, [0, 1], partition=0, offset=i)


class MemorySource:
    """Steps of STEP_GROUPS groups out of GROUPS; ``fail_at`` raises at that step; commits go to a file."""

    topic = "memory"

    def __init__(self, out: Path, fail_at: int = 0) -> None:
        self.accumulator = StepAccumulator(STEP_GROUPS)
        self._groups = [group(i) for i in range(GROUPS)]
        self._number = 0
        self._out = out
        self._fail_at = fail_at

    @property
    def exhausted(self) -> bool:
        return not self._groups

    async def start(self) -> int:
        return 0

    async def next_step(self, timeout: float | None) -> Step | None:
        if not self._groups:
            return None
        if self._number + 1 == self._fail_at:
            raise ConnectionError("the broker went away")
        taken, self._groups = self._groups[:STEP_GROUPS], self._groups[STEP_GROUPS:]
        self._number += 1
        return Step(self._number, taken, {0: taken[-1].offset + 1})

    async def commit(self, entries: list[LedgerEntry]) -> None:
        with self._out.open("a") as handle:
            for e in entries:
                handle.write(json.dumps({"step": e.step, "ranks": e.ranks, "offsets": e.offsets}) + "\n")

    async def close(self) -> None:
        pass


def run_rank(rank: int, world: int, port: int, tmp: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = make_config("127.0.0.1:1", "redis://127.0.0.1:1", "ranks", {"staleness": {"groups_per_step": STEP_GROUPS}})
    out = Path(tmp)
    seen: list[dict[str, Any]] = []
    try:
        source = (lambda: MemorySource(out / "commits.jsonl", fail_at=2 if mode == "fail" else 0))
        with TrainerSteps(config, source=source, wait_seconds=0.5) as batches:
            for batch in batches:
                seen.append({"step": batch.step, "tasks": batch.task_ids, "tokens": batch.tokens,
                             "rank": batch.rank, "world": batch.world_size, "groups": batch.step_groups})
                if mode == "stop" and rank == world - 1 and batch.step == 2:
                    batches.stop()  # a signal on one rank
                batches.commit(batch)
            seen.append({"stopped": batches.stopped, "last": batches.last_committed_step})
    except RankFailed as exc:
        seen.append({"failed": str(exc)})
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(seen))
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(tmp_path: Path, world: int, mode: str) -> list[list[dict[str, Any]]]:
    mp.start_processes(run_rank, args=(world, free_port(), str(tmp_path), mode), nprocs=world, start_method="spawn")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def commits(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "commits.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_every_rank_gets_its_share_in_lockstep_and_each_step_is_committed_once(tmp_path: Path) -> None:
    world = 2  # 3 ranks: tests/integration/test_trainer_torchrun.py
    ranks = run_job(tmp_path, world, "plain")
    steps = [[s for s in seen if "step" in s] for seen in ranks]
    assert all([s["step"] for s in rank] == [1, 2, 3] for rank in steps)  # lockstep, nothing skipped
    for r, rank in enumerate(steps):
        assert all(s["rank"] == r and s["world"] == world and s["groups"] == STEP_GROUPS for s in rank)
    for number in range(3):
        shares = [rank[number]["tasks"] for rank in steps]
        assert all(shares)  # every rank has work
        assert sorted(t for share in shares for t in share) == sorted(f"task-{i}" for i in range(number * STEP_GROUPS, (number + 1) * STEP_GROUPS))
    done = commits(tmp_path)
    assert [c["step"] for c in done] == [1, 2, 3]  # once per step, by rank 0 alone
    assert all(c["ranks"] == [rank[c["step"] - 1]["tasks"] for rank in steps] for c in done)  # the ledger's shares
    assert all(seen[-1] == {"stopped": True, "last": 3} for seen in ranks)  # the exhausted source ends every loop


def test_a_stop_on_one_rank_ends_every_rank_after_the_step(tmp_path: Path) -> None:
    ranks = run_job(tmp_path, 2, "stop")
    assert all([s["step"] for s in seen if "step" in s] == [1, 2] for seen in ranks)
    assert [c["step"] for c in commits(tmp_path)] == [1, 2]


def test_a_failure_on_rank_0_reaches_every_rank(tmp_path: Path) -> None:
    ranks = run_job(tmp_path, 2, "fail")
    for seen in ranks:
        assert [s["step"] for s in seen if "step" in s] == [1]
        assert "ConnectionError: the broker went away" in seen[-1]["failed"]
    assert [c["step"] for c in commits(tmp_path)] == [1]


# -- a torchrun job that loses ranks: heartbeats name the rank, torchrun restarts the job --

RANK_TIMEOUT = 5.0
FILE_GROUPS, FILE_STEPS = 24, 6  # STEP_GROUPS groups a step


def committed_lines(job: TrainerJob) -> list[dict[str, Any]]:
    path = job.out / "commits.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_lines(job: TrainerJob, rank: int, restart: int) -> list[str]:
    return [line for line in job.log_text(rank).splitlines() if f"[rank {rank}, restart {restart}]" in line]


def one_line(lines: list[str], *parts: str) -> str:
    found = [line for line in lines if all(p in line for p in parts)]
    assert len(found) == 1, (parts, lines)
    return found[0]


@pytest.mark.timeout(400)
async def test_a_torchrun_job_recovers_from_a_dead_a_stalled_and_a_failed_rank(tmp_path: Path) -> None:
    """Four runs of one 2-rank job end early, each for another reason, each restarted by
    torchrun (``--max-restarts 4``, as ``rollstream train`` starts it): rank 1 SIGKILLed in
    step 2, SIGSTOPped in step 3, raising in step 4, then rank 0 SIGKILLed in step 5. Every
    time the surviving rank names the lost rank, its step and phase, the restart and where the
    job resumes; the stalled rank is found within the rank timeout; every step is committed
    once and every group trained once."""
    tree = {"experiment": {"experiment_name": "ranks", "trial_name": "t0"},
            "staleness": {"groups_per_step": STEP_GROUPS}, "trainer": {"rank_timeout_seconds": RANK_TIMEOUT}}
    job = TrainerJob("job", 2, tree, tmp_path, steps=FILE_STEPS, max_restarts=4,
                     job_args=["--source", "file", "--groups", str(FILE_GROUPS), "--step-seconds", "0.3",
                               "--fail", "4:2:1"])
    job.start()
    try:
        dead = await job.hurt(1, 2, 0, signal.SIGKILL, 120)
        stalled = await job.hurt(1, 3, 1, signal.SIGSTOP, 120)
        stopped_at = time.monotonic()
        while not pid_gone(stalled):
            assert time.monotonic() - stopped_at < RANK_TIMEOUT + 20, f"the stopped rank was never ended\n{job.tail()}"
            await asyncio.sleep(0.1)
        ended_after = time.monotonic() - stopped_at
        dead_leader = await job.hurt(0, 5, 3, signal.SIGKILL, 120)
        assert await job.wait(180) == 0, job.tail()
    finally:
        job.stop()

    lines = committed_lines(job)
    assert [(c["step"], c["restart"]) for c in lines] == [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4), (6, 4)]
    trained = [t for c in lines for t in c["task_ids"]]
    assert sorted(trained) == sorted(f"task-{i}" for i in range(FILE_GROUPS))  # each once: none lost, none twice
    assert all(all(c["ranks"]) for c in lines)

    def resumes(step: int) -> str:
        return f"the job resumes after step {step} (committed offsets {{0: {step * STEP_GROUPS}}})"

    killed = one_line(run_lines(job, 0, 0), f"rank 1 (pid {dead} on", "is gone")
    assert "in step 2, phase 'train'" in killed and "restart 1 of at most 4" in killed and resumes(1) in killed
    stall = one_line(run_lines(job, 0, 1), f"rank 1 (pid {stalled} on", "stopped answering: no heartbeat for")
    assert "in step 3, phase 'train'" in stall and "restart 2 of at most 4" in stall and resumes(2) in stall
    one_line(run_lines(job, 0, 1), f"ended rank 1 (pid {stalled}, SIGKILL)")
    failed = one_line(run_lines(job, 0, 2), "rank 1 (pid", "failed in step 4, phase 'train'")
    assert "ValueError: injected failure in step 4" in failed and "restart 3 of at most 4" in failed
    leader = one_line(run_lines(job, 1, 3), f"rank 0 (pid {dead_leader} on", "is gone")
    assert "in step 5, phase 'train'" in leader and "restart 4 of at most 4" in leader and resumes(4) in leader
    one_line(run_lines(job, 0, 4), "trainer job of 2 ranks, restart 4 of at most 4: resuming after step 4 "
                                   "(committed offsets {0: 16})")
    assert ended_after < RANK_TIMEOUT + 10, ended_after
    for rank in range(2):  # the survivors said one line each time: no tracebacks, no step they could not finish
        assert "Traceback" not in job.log_text(rank) and "finishing" not in job.log_text(rank)
    launcher = (job.out / "torchrun.log").read_text(errors="replace")
    assert launcher.count("Traceback") == 1 and "ValueError: injected failure in step 4" in launcher  # the failed rank's own
    print(f"\nstalled rank ended {ended_after:.1f} s after its SIGSTOP (rank timeout {RANK_TIMEOUT:g} s)")

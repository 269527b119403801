"""A small trainer job for the torchrun tests: a tiny DDP model, per-rank logs.

    torchrun --nproc-per-node N harness/trainer_job.py --config F --out DIR --steps S
        [--source kafka|file] [--fail STEP:RESTART:RANK]

Every rank appends ``{"event": "start"|"commit", "step", "tasks", "pid", "restart"}`` lines to
``DIR/rank<r>.jsonl`` (each line flushed before the next action, so a SIGKILLed rank's log says
where it died) and writes its log to ``DIR/rank<r>.log``. Each step: a DDP update of a
one-weight model on the share's mean reward (a real gradient all-reduce across the ranks), a
sleep of ``--step-seconds``, the commit. Stops after committing step ``--steps``.

``--source kafka`` (the default) reads ``batches`` in the config's trainer group. ``--source
file`` reads ``--groups`` groups made here, ``staleness.groups_per_step`` a step, and commits steps to
``DIR/commits.jsonl`` (fsynced), where a restarted job resumes: the trainer machinery without a
broker. ``--fail STEP:RESTART:RANK`` makes that rank raise in that step of that restart.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from rollstream.config import load_config
from rollstream.trainer import TrainerSteps
from rollstream.trainer.accumulator import StepAccumulator
from rollstream.trainer.training_step import GroupRows
from rollstream.trainer.ledger import LedgerEntry
from rollstream.trainer.step_source import Step


def file_group(i: int) -> GroupRows:
    length = 3 + (7 * i) % 11  # unequal groups, so the token balance matters
    tensors = {
        "input_ids": torch.full((2, length), i, dtype=torch.int32),
        "attention_mask": torch.ones((2, length), dtype=torch.bool),
        "rewards": torch.tensor([float(i % 3), 0.0]),
    }
    return GroupRows(f"task-{i}", 2, False, 0, tensors, [0, 1], partition=0, offset=i)


class FileSource:
    """Steps of ``batch`` groups out of ``groups``; a commit appends the steps' ledger lines to
    ``path`` (fsynced); a restarted job resumes after the last line, like the Kafka source
    after its committed offsets."""

    topic = "file"

    def __init__(self, path: Path, groups: int, batch: int) -> None:
        self.accumulator = StepAccumulator(batch)
        self.resumed_offsets: dict[int, int] = {}
        self._path, self._groups, self._batch = path, groups, batch
        self._number = self._next = 0

    @property
    def exhausted(self) -> bool:
        return self._next >= self._groups

    async def start(self) -> int:
        lines = self._path.read_text().splitlines() if self._path.exists() else []
        if lines:
            last = json.loads(lines[-1])
            self._number, self._next = last["step"], last["offsets"]["0"]
            self.resumed_offsets = {0: self._next}
        return self._number

    async def next_step(self, timeout: float | None) -> Step | None:
        if self.exhausted:
            return None
        taken = [file_group(i) for i in range(self._next, min(self._next + self._batch, self._groups))]
        self._next += len(taken)
        self._number += 1
        return Step(self._number, taken, {0: self._next})

    async def commit(self, entries: list[LedgerEntry]) -> None:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        data = "".join(json.dumps({"step": e.step, "offsets": e.offsets, "task_ids": e.task_ids, "ranks": e.ranks,
                                   "restart": restart}) + "\n" for e in entries)
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data.encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    async def close(self) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--source", choices=["kafka", "file"], default="kafka")
    parser.add_argument("--groups", type=int, default=0, help="--source file: how many groups")
    parser.add_argument("--fail", default="", help="STEP:RESTART:RANK: that rank raises in that step of that restart")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    logging.basicConfig(filename=args.out / f"rank{rank}.log", level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s %(name)s [rank {rank}, restart {restart}] %(message)s")
    log = (args.out / f"rank{rank}.jsonl").open("a")
    fail = tuple(int(x) for x in args.fail.split(":")) if args.fail else None

    def note(event: str, **fields: object) -> None:
        log.write(json.dumps({"event": event, "rank": rank, "pid": os.getpid(), "restart": restart, **fields}) + "\n")
        log.flush()

    note("up")  # its pid, for a test that must kill what a failed run left
    config = load_config(args.config)
    source = None
    if args.source == "file":
        source = lambda: FileSource(args.out / "commits.jsonl", args.groups, config.staleness.groups_per_step)  # noqa: E731
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with TrainerSteps(config, wait_seconds=1.0, source=source, ledger=source is None) as batches:
        note("resume", last=batches.last_committed_step)
        if batches.last_committed_step >= args.steps:
            return 0
        for batch in batches:
            note("start", step=batch.step, tasks=batch.task_ids, tokens=batch.tokens, world=batch.world_size)
            if fail == (batch.step, restart, rank):
                raise ValueError(f"injected failure in step {batch.step}")
            reward = batch.tensors["rewards"].float().mean().reshape(1, 1)
            loss = (model(reward) - 1.0).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()  # the gradient all-reduce: every rank takes part in every step
            optimizer.step()
            time.sleep(args.step_seconds)
            batches.commit(batch)
            note("commit", step=batch.step)
            if batch.step >= args.steps:
                break
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

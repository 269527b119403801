"""A small trainer job for the torchrun tests: a tiny DDP model, per-rank logs.

    torchrun --nproc-per-node N tests/integration/trainer_job.py --config F --out DIR --steps S

Every rank appends ``{"event": "start"|"commit", "step", "tasks", "pid", "restart"}`` lines to
``DIR/rank<r>.jsonl`` (each line flushed before the next action, so a SIGKILLed rank's log says
where it died). Each step: a DDP update of a one-weight model on the share's mean reward (a
real gradient all-reduce across the ranks), a sleep of ``--step-seconds``, the commit. Stops
after committing step ``--steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from rollstream.config import load_config
from rollstream.trainer import TrainerBatches


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = (args.out / f"rank{rank}.jsonl").open("a")

    def note(event: str, **fields: object) -> None:
        log.write(json.dumps({"event": event, "rank": rank, "pid": os.getpid(), "restart": restart, **fields}) + "\n")
        log.flush()

    note("up")  # its pid, for a test that must kill what a failed run left
    config = load_config(args.config)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with TrainerBatches(config, wait_seconds=1.0) as batches:
        note("resume", last=batches.last_committed_step)
        if batches.last_committed_step >= args.steps:
            return 0
        for batch in batches:
            note("start", step=batch.step, tasks=batch.task_ids, tokens=batch.tokens, world=batch.world_size)
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

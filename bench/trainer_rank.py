"""One rank of the trainer benchmark (``bench/trainer.py`` starts it under ``torchrun``).

    torchrun --nproc-per-node N bench/trainer_rank.py --config F --out DIR --steps S

Reads steps with :class:`rollstream.trainer.TrainerSteps` and notes, for every group of its
share, ``time.monotonic()`` when ``next_step`` handed it out on this rank (CLOCK_MONOTONIC is
one clock for every process of the machine, so the driver compares it with its commit times).
Commits each step at once (no training: the benchmark measures the delivery). Rank 0 writes
``DIR/ready`` once its consumer holds its partitions; each rank writes ``DIR/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist

from rollstream.config import load_config
from rollstream.trainer import KafkaStepSource, TrainerSteps


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()
    world = 1
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        world = dist.get_world_size()
    rank = dist.get_rank() if dist.is_initialized() else 0
    (args.out / f"pid-rank{rank}").write_text(str(os.getpid()))  # torchrun's workers have sessions of their own
    arrivals: dict[str, float] = {}
    steps: list[int] = []
    with TrainerSteps(load_config(args.config), wait_seconds=0.5) as batches:
        source = batches.source
        if isinstance(source, KafkaStepSource):
            deadline = time.monotonic() + 120
            while source.assignments == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            (args.out / "ready").write_text("ready\n")
        for batch in batches:
            now = time.monotonic()
            for task in batch.task_ids:
                arrivals[task] = now
            steps.append(batch.step)
            batches.commit(batch)
            if batch.step >= args.steps:
                break
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world": world, "arrivals": arrivals,
                                                           "steps": steps}))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

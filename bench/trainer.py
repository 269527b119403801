"""Trainer benchmark: a group's commit to ``batches`` -> its arrival on the rank that trains it.

For 1, 2 and 4 ranks (``--ranks``), a ``torchrun`` job of ``bench/trainer_rank.py`` (gloo, CPU)
reads ``batches`` with :class:`rollstream.trainer.TrainerSteps`: rank 0 owns the consumer,
splits each step (``staleness.groups_per_step`` = one group per rank) and scatters the shares. This
process plays the grouping tier: each step's groups (8 episodes of 512 + 1,536 tokens each, one
``EmittedGroup`` record per group, as the grouping tier writes them) go to ``batches``
in one Kafka transaction, one step every ``--spacing-ms``. Latency = from that transaction's
commit being sent to ``next_step`` handing the group out on its rank (both ``time.monotonic()``,
one clock for every process of the machine). The first ``--warmup`` steps are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer

from bench.common import Report, percentiles, run_bench
from bench.data import COMPLETION_TOKENS, PROMPT_TOKENS, scored_episode, trajectory
from harness.configs import write_config
from harness.services import services, unique_name
from harness.tiers import REPO, tail
from rollstream.config import config_from_dict
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.consumers.grouping.groups import CompleteGroup
from rollstream.dev.launcher import Services
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.wire import encode


GROUP_SIZE = 8


def group_record(task_id: str, lengths: tuple[int, int], version: int) -> bytes:
    episodes = tuple(scored_episode(task_id, i, GROUP_SIZE, trajectory(*lengths, seed=i), reward=float(i % 2))
                     for i in range(GROUP_SIZE))
    return encode(build_emitted_group(CompleteGroup(task_id, GROUP_SIZE, False, episodes, 0, 0, 0, 0, 0.0), version))


async def write_steps(producer: AIOKafkaProducer, topic: str, steps: list[list[tuple[str, bytes]]],
                      spacing: float, committed: dict[str, float]) -> None:
    for step in steps:
        await producer.begin_transaction()
        for task_id, value in step:
            await producer.send(topic, value, key=task_id.encode())
        # read_committed readers see the records once the commit is done: from the moment it is
        # sent (its response may come back after a reader already has them)
        sent = time.monotonic()
        await producer.commit_transaction()
        for task_id, _ in step:
            committed[task_id] = sent
        await asyncio.sleep(spacing)


def start_job(ranks: int, config: Path, out: Path, steps: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            str(REPO / "bench" / "trainer_rank.py"), "--config", str(config), "--out", str(out), "--steps", str(steps)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with (out / "torchrun.log").open("ab") as log:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


async def wait_ready(job: subprocess.Popen[bytes], out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (out / "ready").exists():
        if job.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {out.name} trainer job did not get ready:\n{tail(out / 'torchrun.log')}")
        await asyncio.sleep(0.1)


async def measure_ranks(svc: Services, workdir: Path, ranks: int, steps: int, warmup: int, spacing: float,
                        lengths: tuple[int, int]) -> dict[str, Any]:
    name = unique_name("trn")
    out = workdir / name
    out.mkdir()
    tree = {
        "kafka": {"bootstrap_servers": svc.kafka_bootstrap, "partitions": 2},
        "redis": {"url": svc.redis_url},
        "experiment": {"experiment_name": name, "trial_name": "t0"},
        "staleness": {"enabled": False, "groups_per_step": ranks}, "trainer": {"group_id": f"{name}-trainer", "ledger_path": str(out / "ledger.jsonl")},
    }
    config = config_from_dict(tree)
    names = TopicNames(name, "t0")
    await ensure_topics(config.kafka, names)
    path = write_config(out / "config.yaml", tree)
    plan = [[(f"{name}:{s}:{r}", group_record(f"{name}:{s}:{r}", lengths, s)) for r in range(ranks)]
            for s in range(warmup + steps)]
    producer = make_producer(config.kafka, "bench-grouping", transactional_id=f"{name}.bench-grouping")
    job = start_job(ranks, path, out, warmup + steps)
    committed: dict[str, float] = {}
    try:
        await wait_ready(job, out, 180)
        await producer.start()
        await write_steps(producer, names.batches, plan, spacing, committed)
        deadline = time.monotonic() + 60 + steps * spacing * 4
        while job.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {ranks}-rank job did not finish:\n{tail(out / 'torchrun.log')}")
            await asyncio.sleep(0.2)
        if job.returncode != 0:
            raise RuntimeError(f"the {ranks}-rank job failed ({job.returncode}):\n{tail(out / 'torchrun.log')}")
    finally:
        await producer.stop()
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        for pid_file in out.glob("pid-rank*"):  # torchrun's workers run in sessions of their own
            with contextlib.suppress(OSError, ValueError):  # gone already; and a reused pid is not ours
                pid = int(pid_file.read_text())
                if "trainer_rank.py" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.kill(pid, signal.SIGKILL)
    measured = {task for step in plan[warmup:] for task, _ in step}
    per_rank: dict[str, str] = {}
    everyone: list[float] = []
    for rank in range(ranks):
        arrivals = json.loads((out / f"rank{rank}.json").read_text())["arrivals"]
        latencies = [1000 * (at - committed[task]) for task, at in arrivals.items() if task in measured]
        everyone += latencies
        p = percentiles(latencies, (50, 99))
        per_rank[f"rank {rank} p50 / p99"] = f"{p['p50']:.1f} / {p['p99']:.1f}"
    return {"ranks": ranks, "groups": len(everyone), **percentiles(everyone, (50, 99)), "max": max(everyone), **per_rank}


async def measure(args: argparse.Namespace, report: Report) -> None:
    ranks = args.ranks or ([1, 2] if args.quick else [1, 2, 4])
    steps = args.steps or (3 if args.quick else 60)
    warmup = 1 if args.quick else 5
    lengths = (64, 128) if args.quick else (PROMPT_TOKENS, COMPLETION_TOKENS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp, services(Path(tmp)) as dev:
        for n in ranks:
            rows.append(await measure_ranks(dev.services, Path(tmp), n, steps, warmup, args.spacing_ms / 1000, lengths))
    report.table(f"Commit-to-rank latency, ms (a step = one group of {GROUP_SIZE} x {sum(lengths)} tokens per rank, "
                 f"one step every {args.spacing_ms:g} ms)", rows)
    report.note("each group arrives on one rank (its share); 'rank r' columns are the groups rank r trained")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, nargs="*", help="rank counts (default 1 2 4)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per rank count (default 60)")
    parser.add_argument("--spacing-ms", type=float, default=100.0, help="time between steps written")


def main(argv: list[str] | None = None) -> int:
    return run_bench("trainer", __doc__, arguments, measure, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Latency benchmark: last sample of a group written to ``scored`` -> batch visible to the trainer.

For each ``grouping.commit_interval_ms`` (20, 100, 500), a real grouping tier runs in its own
process and a ``read_committed`` ``StepStream`` (trainer batch size 1) reads ``batches`` in
this process. This process plays the reward tier: each group's 8 scored episodes (prompt 512
+ completion 1,536 tokens) go to ``scored`` in one Kafka transaction, one group every
``--spacing-ms``. Latency = from that transaction's commit returning (the samples are then
visible to the grouping consumer) to the ``StepStream`` handing out the group's batch.
Target: p99 <= 250 ms at the default commit interval (100 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from aiokafka import AIOKafkaProducer

from bench.common import Report, percentiles, run_bench
from bench.data import COMPLETION_TOKENS, PROMPT_TOKENS, scored_episode, trajectory
from bench.kafka_tools import wait_for_groups
from harness.configs import write_config
from harness.services import services, unique_name
from harness.tiers import Sampler, TierProcess, wait_until_consuming
from rollstream.trainer import StepStream
from rollstream.config import config_from_dict
from rollstream.dev.launcher import Services
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.wire import encode


GROUP_SIZE = 8
DEFAULT_INTERVAL_MS = 100  # GroupingConfig.commit_interval_ms


def group_records(task_id: str, lengths: tuple[int, int]) -> list[bytes]:
    return [encode(scored_episode(task_id, i, GROUP_SIZE, trajectory(*lengths, seed=i), reward=float(i % 2)))
            for i in range(GROUP_SIZE)]


async def write_groups(producer: AIOKafkaProducer, topic: str, groups: list[tuple[str, list[bytes]]],
                       spacing: float, written: dict[str, float]) -> None:
    for task_id, records in groups:
        await producer.begin_transaction()
        for value in records:
            await producer.send(topic, value, key=task_id.encode())
        await producer.commit_transaction()
        written[task_id] = time.monotonic()
        await asyncio.sleep(spacing)


async def read_batches(consumer: StepStream, expected: int, seen: dict[str, float], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(seen) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(seen)} of {expected} batches arrived")
        batch = await consumer.next_step(timeout=1.0)
        if batch is None:
            continue
        now = time.monotonic()
        for task_id in batch.task_ids:
            seen.setdefault(task_id, now)
        await consumer.ack(batch)


async def measure_interval(svc: Services, workdir: Path, interval_ms: int, groups: int, warmup: int,
                           spacing: float, lengths: tuple[int, int], confirm: bool) -> dict[str, float]:
    name = unique_name("lat")
    tree = {
        "kafka": {"bootstrap_servers": svc.kafka_bootstrap, "partitions": 2},
        "redis": {"url": svc.redis_url},
        "experiment": {"experiment_name": name, "trial_name": "t0"},
        "grouping": {"instance_id": "bench-grouping-0", "commit_interval_ms": interval_ms},
        "staleness": {"groups_per_step": 1},  # a trainer step per group: each group's latency on its own
        "trainer": {"group_id": "bench-trainer"},
    }
    config = config_from_dict(tree)
    names = TopicNames(name, "t0")
    await ensure_topics(config.kafka, names)
    path = write_config(workdir / f"{name}.yaml", tree)
    batches = [(f"{name}:0:{i}", group_records(f"{name}:0:{i}", lengths)) for i in range(warmup + groups)]
    grouping = TierProcess("grouping", path, workdir / f"{name}.grouping.log").start()
    producer = make_producer(config.kafka, "bench-scorer", transactional_id=f"{name}.bench-scorer")
    consumer = StepStream(config, ledger=False, client_id="bench-trainer", poll_timeout_ms=500)
    written: dict[str, float] = {}
    seen: dict[str, float] = {}
    try:
        with Sampler([grouping]):
            await wait_until_consuming([grouping], 90)
            if confirm:
                await wait_for_groups(svc.kafka_bootstrap, [names.group_id("grouping")], 90)
            await producer.start()
            await consumer.start()
            reader = asyncio.create_task(read_batches(consumer, len(batches), seen, 60 + len(batches) * spacing * 2))
            await write_groups(producer, names.scored, batches, spacing, written)
            await reader
    finally:
        await consumer.close()
        await producer.stop()
        grouping.stop()
    measured = [1000 * (seen[t] - written[t]) for t, _ in batches[warmup:]]
    return {"commit_interval_ms": interval_ms, "groups": len(measured), **percentiles(measured),
            "max": max(measured), "grouping peak RSS MB": grouping.peak_rss / 1e6}


async def measure(args: argparse.Namespace, report: Report) -> None:
    intervals = args.intervals or ([DEFAULT_INTERVAL_MS] if args.quick else [20, DEFAULT_INTERVAL_MS, 500])
    groups = args.groups or (5 if args.quick else 120)
    lengths = (64, 128) if args.quick else (PROMPT_TOKENS, COMPLETION_TOKENS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp, services(Path(tmp)) as dev:
        for interval in intervals:
            rows.append(await measure_interval(dev.services, Path(tmp), interval, groups, 2 if args.quick else 10,
                                               args.spacing_ms / 1000, lengths, confirm=not args.quick))
    report.table(f"Group-to-trainer latency, ms (groups of {GROUP_SIZE} x {sum(lengths)} tokens, "
                 f"one every {args.spacing_ms} ms)", rows)
    default = next((r for r in rows if r["commit_interval_ms"] == DEFAULT_INTERVAL_MS), None)
    if default is not None:
        report.target(f"p99 latency at the default commit interval ({DEFAULT_INTERVAL_MS} ms)", default["p99"], 250.0,
                      higher_is_better=False, unit=" ms")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--intervals", type=int, nargs="*", help="commit intervals in ms (default 20 100 500)")
    parser.add_argument("--groups", type=int, default=None, help="measured groups per interval (default 120)")
    parser.add_argument("--spacing-ms", type=float, default=50.0, help="time between groups written")


def main(argv: list[str] | None = None) -> int:
    return run_bench("latency", __doc__, arguments, measure, argv)


if __name__ == "__main__":
    sys.exit(main())

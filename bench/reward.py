"""The reward tier's own work per group, without the broker: CPU of this process and its pool.

What ``rollstream.reward_workers.transform.RewardTransform`` does to the records of one cycle inside the
shared loop (``rollstream.kafka.consume_transform_produce``): every record of the cycle is
transformed concurrently (decode the episode, split prompt from completion, decode both with
the tokenizer, one call of the reward function in the process pool, encode the ``scored``
message). Records as the pipeline's rollout worker writes them (``bench/pipeline.py``): groups
of 8 samples sharing a 512-token prompt, 1,536-token completions of load-generator ids, the
tiny offline tokenizer, ``exact_match_reward`` with ``reward.max_workers`` = 2, and cycles of
``--cycle`` records (the tier's poll batches; at most ``reward.max_batch``).

"CPU-ms per group" = CPU seconds of this process plus its live children (the reward pool's
processes) over the measured cycles, per 8 records. Kafka's share of the tier (fetching,
producing, transactions) is not in it.

``--tier`` measures the tier whole instead, without the other tiers: a real broker, the real
``rollstream reward-worker`` process (``reward.max_batch`` = ``--cycle``), the same records
produced to ``episodes`` once it consumes and has scored two warm-up groups (its pool started);
its CPU (with its pool) from the first record produced to the last ``scored`` record committed.
Two modes, alternated: "scoring" as above, and "floor": episodes that carry their workflow's rewards and no reward function (decoded, validated,
passed through, produced, committed: everything but computing the reward). Their difference
is what scoring costs; the floor is the loop's and Kafka's.

Run the same script on two commits in alternation to compare them (bench/README.md shows how).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from aiokafka.structs import ConsumerRecord

from bench.common import Report, run_bench, time_interleaved
from bench.data import COMPLETION_TOKENS, PROMPT_TOKENS, trajectory
from bench.kafka_tools import wait_for_groups
from harness.configs import write_config
from harness.procstats import cpu_seconds, tree_pids
from harness.services import services, tokenizer_path, unique_name
from harness.tiers import TierProcess, wait_until_consuming
from rollstream.config import RewardConfig, config_from_dict
from rollstream.dev.launcher import Services
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer, make_producer
from rollstream.kafka.consume_transform_produce import PartitionOutput
from rollstream.kafka.topics import TopicNames
from rollstream.reward_workers.reward_function import Scorer
from rollstream.reward_workers.scoring import split_prompt_completion
from rollstream.reward_workers.transform import RewardTransform
from rollstream.wire import Episode, decode_episode, encode
from rollstream.wire.torch_tensors import decode_tensor_dict, encode_tensor_dict


GROUP_SIZE = 8
VOCAB = 512  # the pipeline's load generator draws ids below this (bench/pipeline_run.py)


def process_cpu() -> float:
    """CPU seconds of this process and its live children (the reward process pool)."""
    return sum(cpu_seconds(p) for p in tree_pids(os.getpid()))


def episode_records(groups: int, prompt: int, completion: int, seed: int = 0,
                    scored: bool = False) -> list[ConsumerRecord]:
    """``groups`` x 8 ``episodes`` records, the samples of a group next to each other
    (``scored``: carrying their workflow's rewards)."""
    rng = random.Random(seed)
    records = []
    base = trajectory(prompt, completion)
    for g in range(groups):
        prompt_ids = [(g * 7 + j) % VOCAB for j in range(prompt)]
        for i in range(GROUP_SIZE):
            tensors = dict(base)
            ids = [*prompt_ids, *(rng.randrange(VOCAB) for _ in range(completion))]
            tensors["input_ids"] = torch.tensor([ids], dtype=torch.int32)
            if not scored:
                del tensors["rewards"]
            episode = Episode(task_id=f"bench:{g}", sample_idx=i, group_size=GROUP_SIZE, has_reward=scored,
                              trajectory=encode_tensor_dict(tensors), data={"answer": str(g % 10)})
            value = encode(episode)
            offset = len(records)
            records.append(ConsumerRecord("episodes", 0, offset, 0, 0, episode.task_id.encode(), value, None,
                                          len(episode.task_id), len(value), []))
    return records


async def run_cycles(transform: RewardTransform, records: list[ConsumerRecord], cycle: int) -> Counter[str]:
    """Transform ``records`` in cycles of ``cycle``, as the loop does; counts of the outcomes."""
    outcomes: Counter[str] = Counter()
    for start in range(0, len(records), cycle):
        batch = records[start:start + cycle]
        await transform.begin({0: batch})
        outs = [PartitionOutput(0, 1 << 30) for _ in batch]
        await asyncio.gather(*(transform.transform(r, out) for r, out in zip(batch, outs)))
        outcomes.update(kind for out in outs for kind in ["sent"] * len(out.records))
    return outcomes


async def tier_run(services_: Services, workdir: Path, warm: list[ConsumerRecord], records: list[ConsumerRecord],
                   cycle: int, floor: bool, timeout: float) -> dict[str, float]:
    """One reward-worker process scoring ``warm``, then ``records``: its CPU seconds and the wall
    seconds for ``records``."""
    name = unique_name("rbench")
    tree = {
        "kafka": {"bootstrap_servers": services_.kafka_bootstrap, "partitions": 2},
        "redis": {"url": services_.redis_url},
        "experiment": {"experiment_name": name, "trial_name": "t0"},
        "reward": {"tokenizer_path": str(tokenizer_path()), "worker_id": "bench-reward-0", "max_workers": 2,
                   "max_batch": cycle, **({"reward_fn": ""} if floor else {})},
        "log_level": "INFO",
    }
    config = config_from_dict(tree)
    names = TopicNames(name, "t0")
    await ensure_topics(config.kafka, names)
    path = write_config(workdir / f"{name}.yaml", tree)
    worker = TierProcess("reward-worker", path, workdir / f"{name}.log").start()
    counter = make_consumer(config.kafka, "bench-scored", names.scored, group_id=None)
    producer = make_producer(config.kafka, "bench-episodes")
    await counter.start()
    await producer.start()
    try:
        await wait_until_consuming([worker], timeout)
        await wait_for_groups(services_.kafka_bootstrap, [names.group_id("reward-worker")], timeout)
        seen = 0

        async def score(batch: list[ConsumerRecord]) -> None:
            nonlocal seen
            for record in batch:
                await producer.send(names.episodes, record.value, key=record.key)
            await producer.flush()
            deadline, goal = time.monotonic() + timeout, seen + len(batch)
            while seen < goal:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {seen} of {goal} records scored within {timeout:.0f}s")
                worker.check_alive()
                seen += sum(len(b) for b in (await counter.getmany(timeout_ms=200)).values())

        await score(warm)  # the pool's processes start on the first records: not counted
        worker.sample()
        cpu, wall = worker.cpu_seconds, time.perf_counter()
        await score(records)
        wall = time.perf_counter() - wall
        worker.sample()
        return {"CPU s": worker.cpu_seconds - cpu, "wall s": wall}
    finally:
        await producer.stop()
        await counter.stop()
        worker.stop()


async def measure_tier(args: argparse.Namespace, report: Report) -> None:
    prompt = 64 if args.quick else PROMPT_TOKENS
    completion = 128 if args.quick else COMPLETION_TOKENS
    groups = 4 if args.quick else args.groups
    data = {mode: episode_records(groups, prompt, completion, scored=mode == "floor") for mode in ("scoring", "floor")}
    warm = {mode: episode_records(2, prompt, completion, seed=1, scored=mode == "floor") for mode in data}
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp, services(Path(tmp)) as dev:
        for rnd in range(args.rounds):
            for mode, records in data.items():
                got = await tier_run(dev.services, Path(tmp), warm[mode], records, args.cycle, mode == "floor", 150.0)
                rows.append({"mode": mode, "round": rnd + 1, "groups": groups, "max_batch": args.cycle,
                             "CPU-ms per group": 1000 * got["CPU s"] / groups, "wall s": got["wall s"]})
    report.table("The reward-worker process (with its pool) per group of 8, alone on a broker", rows)
    for mode in data:
        report.extra[f"tier_{mode}_cpu_ms_per_group"] = [r["CPU-ms per group"] for r in rows if r["mode"] == mode]
    report.note("floor: episodes carrying their workflow's rewards and no reward function (no text decoding, "
                "no pool): the loop's and Kafka's share of the tier")


async def measure(args: argparse.Namespace, report: Report) -> None:
    if args.tier:
        await measure_tier(args, report)
        return
    prompt = 64 if args.quick else PROMPT_TOKENS
    completion = 128 if args.quick else COMPLETION_TOKENS
    groups = 4 if args.quick else args.groups
    config = RewardConfig(tokenizer_path=str(tokenizer_path()), max_workers=2)
    scorer = Scorer.from_config(config, "bench-reward")
    transform = RewardTransform(TopicNames("bench", "t0"), scorer)
    try:
        warm = episode_records(2, prompt, completion, seed=1)
        await run_cycles(transform, warm, args.cycle)  # starts the pool, loads what is lazy
        records = episode_records(groups, prompt, completion)
        rows = []
        for rnd in range(args.rounds):
            wall, cpu = time.perf_counter(), process_cpu()
            outcomes = await run_cycles(transform, records, args.cycle)
            wall, cpu = time.perf_counter() - wall, process_cpu() - cpu
            assert outcomes["sent"] == len(records), outcomes
            rows.append({"round": rnd + 1, "groups": groups, "records per cycle": args.cycle,
                         "CPU-ms per group": 1000 * cpu / groups, "wall ms per group": 1000 * wall / groups})
        report.table("Reward tier's work per group of 8 (this process + its reward pool; no broker)", rows)
        episode = decode_episode(records[0].value)
        tensors = decode_tensor_dict(episode.trajectory)
        prompt_ids, completion_ids = split_prompt_completion(tensors)
        pieces = time_interleaved({
            "decode_episode + decode_tensor_dict":
                lambda: decode_tensor_dict(decode_episode(records[0].value).trajectory),
            "split_prompt_completion": lambda: split_prompt_completion(tensors),
            "tokenizer decode, prompt (512 ids)": lambda: scorer.decode(prompt_ids),
            "tokenizer decode, completion (1,536 ids)": lambda: scorer.decode(completion_ids),
        }, total_seconds=0.5 if args.quick else 2.0)
        report.table("Pieces of one record (the fastest of short loops, µs)",
                     [{"piece": k, "µs": 1e6 * v} for k, v in pieces.items()])
        best = min(r["CPU-ms per group"] for r in rows)
        report.extra.update(cpu_ms_per_group=[r["CPU-ms per group"] for r in rows], best_cpu_ms_per_group=best,
                            cycle=args.cycle, groups=groups)
    finally:
        await scorer.aclose()


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", type=int, default=100, help="groups of 8 per round (default 100)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    parser.add_argument("--cycle", type=int, default=16, help="records per cycle (default 16)")
    parser.add_argument("--tier", action="store_true", help="the reward-worker process on a broker, with a floor")


def main(argv: list[str] | None = None) -> int:
    return run_bench("reward", __doc__, arguments, measure, argv)


if __name__ == "__main__":
    sys.exit(main())

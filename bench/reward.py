"""The reward tier's own work per group, without the broker: CPU of this process and its pool.

What ``reward_workers.transform.RewardTransform`` does to the records of one cycle inside the
shared loop (``rollstream.kafka.consume_transform_produce``): every record of the cycle is
transformed concurrently (decode the episode, split prompt from completion, decode both with
the tokenizer, one call of the reward function in the process pool, encode the ``scored``
message). Records as the pipeline's rollout worker writes them (``bench/pipeline.py``): groups
of 8 samples sharing a 512-token prompt, 1,536-token completions of load-generator ids, the
tiny offline tokenizer, ``exact_match_reward`` with ``reward.max_workers`` = 2, and cycles of
``--cycle`` records (the tier's poll batches; at most ``reward.max_batch``).

"CPU-ms per group" = CPU seconds of this process plus its live children (the reward pool's
processes) over the measured cycles, per 8 records. Kafka's share of the tier (fetching,
producing, transactions) is not in it: ``bench/pipeline.py`` measures the tier whole. Run the
same script on two commits in alternation to compare them (bench/README.md shows how).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from collections import Counter

import torch
from aiokafka.structs import ConsumerRecord

from bench.common import Report, base_parser, time_interleaved
from bench.data import COMPLETION_TOKENS, PROMPT_TOKENS, trajectory
from bench.procstats import cpu_seconds, tree_pids
from bench.stack import tokenizer_path
from reward_workers.scorer import Scorer
from reward_workers.scoring import split_prompt_completion
from reward_workers.transform import RewardTransform
from rollstream.config import RewardConfig
from rollstream.kafka.consume_transform_produce import PartitionOutput
from rollstream.kafka.topics import TopicNames
from rollstream.wire import Episode, decode_episode, decode_tensor_dict, encode, encode_tensor_dict

GROUP_SIZE = 8
VOCAB = 512  # the pipeline's load generator draws ids below this (bench/pipeline_run.py)


def process_cpu() -> float:
    """CPU seconds of this process and its live children (the reward process pool)."""
    return sum(cpu_seconds(p) for p in tree_pids(os.getpid()))


def episode_records(groups: int, prompt: int, completion: int, seed: int = 0) -> list[ConsumerRecord]:
    """``groups`` x 8 ``episodes`` records, the samples of a group next to each other."""
    rng = random.Random(seed)
    records = []
    base = trajectory(prompt, completion)
    for g in range(groups):
        prompt_ids = [(g * 7 + j) % VOCAB for j in range(prompt)]
        for i in range(GROUP_SIZE):
            tensors = dict(base)
            ids = [*prompt_ids, *(rng.randrange(VOCAB) for _ in range(completion))]
            tensors["input_ids"] = torch.tensor([ids], dtype=torch.int32)
            del tensors["rewards"]
            episode = Episode(task_id=f"bench:{g}", sample_idx=i, group_size=GROUP_SIZE,
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


async def measure(args, report: Report) -> None:  # type: ignore[no-untyped-def]
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
            "decode_episode + decode_tensor_dict": lambda: decode_tensor_dict(decode_episode(records[0].value).trajectory),
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


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("reward", __doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=100, help="groups of 8 per round (default 100)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    parser.add_argument("--cycle", type=int, default=16, help="records per cycle (default 16)")
    args = parser.parse_args(argv)
    report = Report("reward", args.quick)
    asyncio.run(measure(args, report))
    return report.finish(args.out)


if __name__ == "__main__":
    sys.exit(main())

"""In-process baseline: the same workflow and reward in a plain asyncio executor, no broker.

The reference system's shape: one process runs ``RLVRWorkflow`` (the pipeline's default
workflow) on the LOAD GENERATOR engine with at most ``--max-concurrent-rollouts`` episodes at
once, ``group_size`` episodes per prompt gathered and padded with ``concat_padded_tensors``,
and the reward (``exact_match_reward`` on the tiny tokenizer's text, in the same process pool
wrapper the reward tier uses) computed inside the workflow. A consumer takes the padded groups
as a trainer would. Same prompt and completion lengths as ``bench/pipeline.py``.

With ``bench/results/pipeline.json`` present (run ``python -m bench.pipeline`` first), it
prints what durability costs per episode: the pipeline's CPU and wall time per episode minus
this baseline's.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from transformers import AutoTokenizer

from bench.common import RESULTS_DIR, Report, base_parser
from bench.data import COMPLETION_TOKENS, PROMPT_TOKENS
from bench.load_engine import LoadGeneratorEngine
from harness.procstats import cpu_seconds, tree_pids
from harness.services import tokenizer_path
from rollstream.api.io_struct import GenerationHyperparameters
from rollstream.rewards import exact_match_reward
from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.workflows.rlvr import RLVRWorkflow


def process_cpu() -> float:
    """CPU seconds of this process and its live children (the reward process pool)."""
    return sum(cpu_seconds(p) for p in tree_pids(os.getpid()))


async def run(prompts: int, group_size: int, prompt_tokens: int, completion_tokens: int,
              rate: float, concurrency: int) -> dict[str, float]:
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path()))
    gconfig = GenerationHyperparameters(max_new_tokens=completion_tokens,
                                        max_tokens=prompt_tokens + completion_tokens + 1)
    workflow = RLVRWorkflow(gconfig, tokenizer, reward_fn=exact_match_reward, reward_max_workers=2)
    engine = LoadGeneratorEngine(tokens_per_second=rate, vocab_size=tokenizer.vocab_size)
    slots = asyncio.Semaphore(concurrency)
    groups: asyncio.Queue = asyncio.Queue()
    vocab = tokenizer.vocab_size

    async def episode(data: dict) -> dict:
        async with slots:
            return await workflow.arun_episode(engine, dict(data))

    async def prompt(i: int) -> None:
        data = {"input_ids": [(i * 7 + j) % vocab for j in range(prompt_tokens)], "answer": str(i % 10)}
        rows = await asyncio.gather(*(episode(data) for _ in range(group_size)))
        await groups.put(concat_padded_tensors(rows))

    await workflow.arun_episode(engine, {"input_ids": [1] * prompt_tokens, "answer": "1"})  # start the pool
    cpu0, start = process_cpu(), time.monotonic()
    tasks = [asyncio.create_task(prompt(i)) for i in range(prompts)]
    times, episodes, generated = [], 0, 0
    for _ in range(prompts):
        batch = await groups.get()
        times.append(time.monotonic())
        episodes += batch["input_ids"].shape[0]
        generated += int(batch["loss_mask"].sum())
    await asyncio.gather(*tasks)
    cpu = process_cpu() - cpu0
    await workflow.aclose()
    steady = times[-1] - times[0]
    share = (prompts - 1) / prompts
    return {"groups": prompts, "episodes": episodes, "generated tokens": generated,
            "steady s": steady, "wall s": times[-1] - start,
            "episodes/s": episodes * share / steady, "tokens/s (generated)": generated * share / steady,
            "groups/s": prompts * share / steady, "CPU s": cpu, "CPU ms/episode": 1000 * cpu / episodes}


def compare(ours: dict[str, float], report: Report) -> None:
    path = RESULTS_DIR / "pipeline.json"
    if not path.exists():
        report.note(f"no {path}: run `python -m bench.pipeline` first to see the per-episode cost of durability")
        return
    pipe = json.loads(path.read_text())
    extra = pipe["extra"]
    p_eps, p_cpu = extra["episodes_per_second"], sum(extra["cpu_seconds"].values()) / extra["episodes"]
    rows = [
        {"path": "in-process asyncio executor (this run)", "episodes/s": ours["episodes/s"],
         "wall ms/episode": 1000 / ours["episodes/s"], "CPU ms/episode": ours["CPU ms/episode"]},
        {"path": f"rollstream pipeline ({pipe['machine']['date']})", "episodes/s": p_eps,
         "wall ms/episode": 1000 / p_eps, "CPU ms/episode": 1000 * p_cpu},
    ]
    rows.append({"path": "cost of durability (pipeline - in-process)", "episodes/s": float("nan"),
                 "wall ms/episode": rows[1]["wall ms/episode"] - rows[0]["wall ms/episode"],
                 "CPU ms/episode": rows[1]["CPU ms/episode"] - rows[0]["CPU ms/episode"]})
    report.table("What durability costs per episode (CPU: every process, broker included)", rows)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("inprocess", __doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=None, help="groups (default 300; --quick 4)")
    parser.add_argument("--tokens-per-second", type=float, default=0.0, help="load generator rate (0: unlimited)")
    parser.add_argument("--max-concurrent-rollouts", type=int, default=64)
    args = parser.parse_args(argv)
    report = Report("inprocess", args.quick)
    prompts = args.prompts or (4 if args.quick else 300)
    lengths = (64, 128) if args.quick else (PROMPT_TOKENS, COMPLETION_TOKENS)
    ours = asyncio.run(run(prompts, 8, *lengths, args.tokens_per_second, args.max_concurrent_rollouts))
    report.table(f"In-process executor: RLVR + exact_match reward on the load generator, group size 8, "
                 f"prompt {lengths[0]} + completion {lengths[1]} tokens", [ours])
    report.extra.update(ours)
    compare(ours, report)
    return report.finish(args.out)


if __name__ == "__main__":
    sys.exit(main())

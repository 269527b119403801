"""Sizing: CPU seconds of the whole pipeline, broker included, per million generated tokens.

Every tier in its own process on the LOAD GENERATOR engine (``bench/load_engine.py``, tokens as
fast as the CPU allows), one run per case through ``bench.pipeline_run.run_pipeline`` on one
broker: short (128 prompt + 256 completion tokens), medium (256 + 1,024) and long (512 + 1,536)
episodes at group sizes 8 and 16. CPU is counted by process from the moment every tier is in its
consumer group (``harness.procstats``): producer, rollout worker, reward worker, grouping, the
trainer-side reader (``StepStream``: this process) and the broker (java). Each case runs
``--rounds`` times, the rounds alternating across cases; the table gives the lower CPU per
million and the spread. Targets at group size 8: long <= 2 CPU-s per million generated tokens,
short <= 8. ``docs/DEPLOYMENT.md`` ("Cores per GPU") turns the figures into cores per GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.common import Report, load_average, run_bench
from bench.pipeline_run import PipelineResult, PipelineSettings, run_pipeline
from harness.services import services


# name -> (prompt tokens, completion tokens)
EPISODES = {"short": (128, 256), "medium": (256, 1024), "long": (512, 1536)}
GROUP_SIZES = (8, 16)
CASES = [f"{name}-{g}" for name in EPISODES for g in GROUP_SIZES]
TARGETS = {"long-8": 2.0, "short-8": 8.0}  # CPU-s per million generated tokens, at most
# per-tier columns: the column -> the process names of PipelineResult.cpu_seconds
TIER_COLUMNS = {
    "producer": "producer", "rollout": "rollout-worker", "reward": "reward-worker", "grouping": "grouping",
    "reader": "trainer (StepStream, this process)", "broker": "kafka broker (java)",
}


def case_settings(case: str, tokens: float, quick: bool) -> PipelineSettings:
    """Enough prompts that the case generates about ``tokens`` tokens (start-up amortized)."""
    name, group = case.rsplit("-", 1)
    prompt, completion = EPISODES[name]
    group_size = int(group)
    if quick:
        return PipelineSettings(prompts=2, group_size=group_size, prompt_tokens=16, completion_tokens=16,
                                timeout_s=90, confirm_ready=False, partitions=2)
    prompts = max(20, round(tokens / (group_size * completion)))
    return PipelineSettings(prompts=prompts, group_size=group_size, prompt_tokens=prompt, completion_tokens=completion,
                            timeout_s=300, partitions=2)


def per_million(r: PipelineResult) -> dict[str, float]:
    """CPU-s per million generated tokens: total and per tier column."""
    scale = 1e6 / max(1, r.generated_tokens)
    row = {"total": scale * sum(r.cpu_seconds.values())}
    for column, process in TIER_COLUMNS.items():
        row[column] = scale * r.cpu_seconds.get(process, 0.0)
    return row


async def measure(args: argparse.Namespace, report: Report) -> None:
    cases = args.cases or (["short-8"] if args.quick else CASES)
    unknown = set(cases) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; choose from {CASES}")
    rounds = 1 if args.quick else args.rounds
    runs: dict[str, list[tuple[PipelineResult, tuple[float, ...]]]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory(prefix="rollstream-sizing-") as tmp, services(Path(tmp)) as dev:
        broker_pid = dev.broker.pid if dev.broker else None
        if not args.quick:  # the broker's JVM compiles its transaction paths on the first run: not counted
            await run_pipeline(dev.services, Path(tmp) / "warmup", case_settings("long-8", 1e6, False),
                               broker_pid=broker_pid)
        for i in range(rounds):
            for case in cases:
                load = load_average()
                s = case_settings(case, args.tokens, args.quick)
                r = await run_pipeline(dev.services, Path(tmp) / f"{case}-{i}", s, broker_pid=broker_pid)
                runs[case].append((r, load))
                print(f"{case} round {i + 1}: {r.generated_tokens:,} tokens, "
                      f"{per_million(r)['total']:.2f} CPU-s/M, load {load[0]:.1f}", flush=True)
    rows = []
    for case, results in runs.items():
        figures = [per_million(r) for r, _ in results]
        best = min(range(len(results)), key=lambda k: figures[k]["total"])
        r, load = results[best]
        totals = [f["total"] for f in figures]
        target = TARGETS.get(case)
        row = {"case": case, "prompt+completion": "+".join(map(str, EPISODES[case.rsplit("-", 1)[0]])),
               "prompts": len(r.batch_times), "generated tok/s": r.rate(r.generated_tokens),
               "CPU-s/M total": figures[best]["total"],
               **{f"{c} CPU-s/M": figures[best][c] for c in TIER_COLUMNS},
               "rounds (total)": " / ".join(f"{t:.2f}" for t in totals),
               "spread %": 100 * (max(totals) - min(totals)) / max(totals) if len(totals) > 1 else 0.0,
               "load avg": load[0],
               "target": f"<= {target:g}" if target else "",
               "verdict": ("PASS" if figures[best]["total"] <= target else "MISS") if target else ""}
        rows.append(row)
        if target:
            report.target(f"{case}: CPU-s per million generated tokens", figures[best]["total"], target,
                          higher_is_better=False)
    report.table("CPU-s per million generated tokens, whole pipeline with the broker (the lower of the rounds; "
                 "per tier from the same run)", rows)
    report.note("cores for the pipeline at N generated tokens/s = N x (CPU-s/M total) / 1e6 (docs/DEPLOYMENT.md)")
    report.note("tok/s is what 2 shared cores reach with the load generator as fast as the CPU allows; "
                "the producer's column includes its start-up (imports), started once the other tiers are ready")
    report.extra.update(cases={c: [{"cpu_seconds": r.cpu_seconds, "generated_tokens": r.generated_tokens,
                                    "groups": r.groups, "steady_seconds": r.steady_seconds, "load": list(load)}
                                   for r, load in results] for c, results in runs.items()})


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", nargs="+", default=None, help=f"cases to run (default all: {' '.join(CASES)})")
    parser.add_argument("--rounds", type=int, default=2, help="runs per case, alternating across cases")
    parser.add_argument("--tokens", type=float, default=3e6, help="generated tokens per run (sets the prompts)")


def main(argv: list[str] | None = None) -> int:
    return run_bench("sizing", __doc__, arguments, measure, argv)


if __name__ == "__main__":
    sys.exit(main())

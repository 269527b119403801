"""``rollstream demo | train``.

    rollstream demo [--steps N] [--workers W] [--run-dir D] [--no-live] [--agent] [--engine hf|vllm]
                    [--weight-transfer checkpoint|distributed]
    rollstream train --config F [--ranks N] [--max-restarts R]  # the example GRPO trainer (torchrun)

Handlers return the process exit code (0 ok, 1 failed, 2 bad arguments or config, 130
interrupted).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from rollstream.config import ConfigError, load_config



def register(subparsers: Any) -> None:
    from rollstream.cli import add_config_arguments

    _register_demo(subparsers)
    train = subparsers.add_parser("train", help="run the example GRPO trainer (examples/grpo_trainer.py) on the batches topic")
    add_config_arguments(train)
    train.add_argument("--ranks", type=int, default=1, help="trainer ranks, DDP across them under torchrun (default 1)")
    train.add_argument("--max-restarts", type=int, default=None,
                       help="how often torchrun starts a failed trainer job again, resuming after its last committed "
                            "step (default: trainer.max_restarts, 3; 0 with one rank: a plain process)")
    train.add_argument("--steps-file", type=Path, default=None, help="rank 0 appends one JSON line per step here")
    train.set_defaults(func=_train_command)


def _register_demo(subparsers: Any) -> None:
    from rollstream.demo.settings import DemoSettings

    d = DemoSettings()
    p = subparsers.add_parser(
        "demo", help="the whole pipeline on this machine: tiny model, local Kafka + Redis, GRPO trainer",
        description="Runs producer, rollout worker(s), reward worker, grouping and dump as subprocesses and "
                    "the example GRPO trainer in-process on one-digit sums; prints the reward increase.",
    )
    p.add_argument("--steps", type=int, default=d.steps, help=f"trainer steps (default {d.steps})")
    p.add_argument("--workers", type=int, default=d.workers, help=f"rollout workers (default {d.workers})")
    p.add_argument("--trainer-ranks", type=int, default=d.trainer_ranks,
                   help=f"trainer ranks, DDP across them under torchrun (default {d.trainer_ranks})")
    p.add_argument("--trainer-restarts", type=int, default=d.trainer_restarts,
                   help=f"how often torchrun starts a failed trainer again (default {d.trainer_restarts})")
    p.add_argument("--run-dir", type=Path, default=None, help="where everything goes (default runs/demo/<time>)")
    p.add_argument("--no-live", dest="live", action="store_false", help="plain lines instead of the live view")
    p.add_argument("--group-size", type=int, default=d.group_size, help=f"samples per prompt (default {d.group_size})")
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step,
                   help=f"groups per trainer step (default {d.prompts_per_step})")
    p.add_argument("--lr", type=float, default=d.learning_rate, help=f"learning rate (default {d.learning_rate})")
    p.add_argument("--eta", type=int, default=d.max_head_offpolicyness,
                   help=f"max_head_offpolicyness (default {d.max_head_offpolicyness})")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help=f"supervised format warm-up steps (default {d.warmup_steps})")
    p.add_argument("--max-operand", type=int, default=d.max_operand, choices=range(1, 10), metavar="1..9",
                   help=f"questions a+b with a, b <= this (default {d.max_operand}; 9: every sum below 10, harder)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--engine", choices=("hf", "vllm"), default=d.engine,
                   help="where the rollout workers generate: hf (in-process transformers, default) or vllm (a local "
                        "vLLM server the demo starts from the environment scripts/setup.sh installs)")
    p.add_argument("--device", default=d.device,
                   help=f"where the rollout workers' HF engine and the trainer run: cpu, cuda or cuda:N (default {d.device})")
    p.add_argument("--weight-transfer", choices=("checkpoint", "distributed"), default=d.weight_transfer,
                   help="how each version reaches the vLLM server: checkpoint (it loads the trainer's checkpoint, "
                        "default) or distributed (the trainer sends the tensors over gloo; a checkpoint every "
                        f"{d.checkpoint_every} versions; implies --engine vllm)")
    p.add_argument("--launch", action="append", default=[], metavar="KEY=VALUE",
                   help="with --engine vllm: a rollout.launch setting of the server (repeatable), e.g. "
                        "--launch dtype=bfloat16 --launch max_num_seqs=16 (docs/DEPLOYMENT.md)")
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds (default 900)")
    p.add_argument("--agent", action="store_true",
                   help="answer through the example agent (examples/agent_calculator.py: openai client, calculator "
                        "tool) on the rollout workers' OpenAI-compatible endpoint, instead of the RLVR workflow")
    p.add_argument("--prepare-only", action="store_true",
                   help="only write the warmed-up model and the dataset into --run-dir (kept if there), then exit")
    p.set_defaults(func=_demo_command)


def _demo_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rollstream.demo.runner import DemoOptions, default_run_dir, run_demo
    from rollstream.demo.settings import DemoSettings, demo_launch

    checks = [(args.steps >= 1, "--steps"), (args.workers >= 1, "--workers"), (args.group_size >= 2, "--group-size"),
              (args.prompts_per_step >= 1, "--prompts-per-step"), (args.lr > 0, "--lr"), (args.eta >= 0, "--eta"),
              (args.warmup_steps >= 0, "--warmup-steps"), (args.timeout > 0, "--timeout"),
              (1 <= args.trainer_ranks <= args.prompts_per_step, "--trainer-ranks (1 to --prompts-per-step)"),
              (args.trainer_restarts >= 0, "--trainer-restarts")]
    launch = {}
    for item in args.launch:
        key, sep, value = item.partition("=")
        checks.append((bool(sep and key), f"--launch {item!r} (KEY=VALUE)"))
        launch[key.strip()] = yaml.safe_load(value)
    bad = [name for ok, name in checks if not ok]
    if bad:
        print(f"rollstream demo: invalid {', '.join(bad)}", file=sys.stderr)
        return 2
    settings = DemoSettings(
        steps=args.steps, workers=args.workers, trainer_ranks=args.trainer_ranks,
        trainer_restarts=args.trainer_restarts, group_size=args.group_size,
        prompts_per_step=args.prompts_per_step, learning_rate=args.lr, max_head_offpolicyness=args.eta,
        warmup_steps=args.warmup_steps, seed=args.seed, max_operand=args.max_operand,
        engine="vllm" if args.weight_transfer == "distributed" else args.engine, weight_transfer=args.weight_transfer,
        launch=launch, device=args.device,
    )
    try:
        demo_launch(settings)
    except ConfigError as exc:
        print(f"rollstream demo: --launch: {exc}", file=sys.stderr)
        return 2
    console = Console()
    if args.prepare_only:
        from rollstream.demo.runner import prepare_only

        prepare_only(settings, (args.run_dir or default_run_dir()).resolve(), console, agent=args.agent)
        return 0
    options = DemoOptions(settings, args.run_dir or default_run_dir(), live=args.live and console.is_terminal,
                          timeout_seconds=args.timeout, agent=args.agent)
    result = run_demo(options, console)
    _print_result(result, console)
    if result.reason == "done":
        return 0
    return 130 if result.reason == "interrupted" else 1


def _print_result(result: Any, console: Any) -> None:
    from rollstream.demo.report import reward_trend, summary_table

    reports = result.reports
    last = reports[-1] if reports else None
    stale = [r.staleness_mean for r in reports]
    rows = [
        ("result", result.reason),
        ("wall time", f"{result.seconds:.0f}s"),
        ("trainer steps", f"{len(reports)} ({reports[-1].ranks} rank{'s' if reports[-1].ranks > 1 else ''})" if reports else "0"),
        ("final version", str(last.version) if last else "0"),
        ("episodes trained", str(sum(r.episodes for r in reports))),
        ("reward first step / last step", f"{reports[0].reward_mean:.3f} / {last.reward_mean:.3f}" if last else "-"),
        ("staleness mean / max", f"{sum(stale) / len(stale):.2f} / {max(r.staleness_max for r in reports)}" if stale else "-"),
        ("weight reloads by rollout workers", f"{len(result.reloads)} (last version {max(result.reloads)})" if result.reloads else "0"),
        ("tier exit codes", ", ".join(f"{k}={v}" for k, v in result.exit_codes.items()) or "-"),
        ("run directory", str(result.run_dir)),
        ("reward plot", str(result.plot) if result.plot else "-"),
    ]
    console.print(summary_table(rows))
    trend = reward_trend(result.rewards)
    if not math.isnan(trend.first):
        console.print(trend.line(), highlight=False)


def _train_command(args: argparse.Namespace) -> int:
    """Replace this process with the example trainer (under torchrun, which restarts a failed
    job up to ``--max-restarts`` / ``trainer.max_restarts`` times)."""
    from rollstream.demo.example_trainer import TORCHRUN_ENV, trainer_argv

    try:
        config = load_config(args.config, args.overrides)  # a bad config is answered here, before torchrun starts
        if args.ranks < 1:
            raise ConfigError("--ranks must be >= 1")
        restarts = config.trainer.max_restarts if args.max_restarts is None else args.max_restarts
        if restarts < 0:
            raise ConfigError("--max-restarts must be >= 0")
        argv = trainer_argv(args.config, args.ranks, args.steps_file, args.overrides, restarts)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"rollstream train: {exc}", file=sys.stderr)
        return 2
    for name, value in TORCHRUN_ENV.items():
        os.environ.setdefault(name, value)
    os.execv(argv[0], argv)
    return 1  # not reached

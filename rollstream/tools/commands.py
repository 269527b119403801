"""``rollstream replay | tail | status | topics create``: the operators' tools on the command line.

Each subcommand takes ``--config/-c`` and ``--set`` like the tiers; the topics are those of
the configured experiment and trial. Handlers return the process exit code (2: bad arguments
or configuration, 1: the tool failed, 130: interrupted).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rollstream.cli import add_config_arguments
from rollstream.config import ConfigError, RollstreamConfig, load_config, secret_values
from rollstream.runtime.logs import setup_logging
from rollstream.runtime.shutdown import ShutdownSignal
from rollstream.tools.filters import RecordFilter
from rollstream.tools.positions import parse_offset_specs, parse_since
from rollstream.tools.roles import ROLES

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    p = _tool(subparsers, "replay", "replay a topic into a dump, a JSONL file or another experiment", _replay_command,
              role=True)
    start = p.add_mutually_exclusive_group()
    start.add_argument("--from-beginning", action="store_true", help="start at the first offset (default)")
    start.add_argument("--offset", action="append", default=[], metavar="P:O", help="start partition P at offset O (repeatable; a bare O means every partition)")
    start.add_argument("--since", metavar="TIME", help="start at the first record at or after TIME (ISO 8601, naive = UTC, or epoch ms)")
    p.add_argument("--task-id", action="append", default=[], help="keep only this task (repeatable)")
    p.add_argument("--min-version", type=int, help="keep tail version >= this")
    p.add_argument("--max-version", type=int, help="keep tail version <= this")
    p.add_argument("--eval", dest="is_eval", action=argparse.BooleanOptionalAction, default=None, help="keep only eval (--eval) or only training (--no-eval) messages")
    p.add_argument("--min-reward", type=float)
    p.add_argument("--max-reward", type=float)
    p.add_argument("--to-dump", type=Path, metavar="DIR", help="write trajectory dumps under DIR")
    p.add_argument("--to-jsonl", type=Path, metavar="FILE", help="write decoded messages, one JSON line each")
    p.add_argument("--tensors", choices=("full", "summary"), default="full", help="tensors in --to-jsonl: full values (default) or dtype/shape/digest")
    p.add_argument("--to-experiment", metavar="NAME", help="re-publish the raw records into this experiment's topic of the same role")
    p.add_argument("--to-trial", metavar="T", help="trial of --to-experiment (default: the source trial)")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer for --to-dump (default: rollout.tokenizer_path, reward.tokenizer_path, rollout.model_path)")
    p.add_argument("--resume-file", type=Path, metavar="F", help="save progress here; a later run with it continues")
    p.add_argument("--checkpoint-every", type=int, default=100, metavar="N", help="save the resume file every N records")
    p.add_argument("--max-records", type=int, metavar="N", help="stop (resumably) after reading N records")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = _tool(subparsers, "tail", "print a topic's messages as they arrive", _tail_command, role=True)
    p.add_argument("--from-beginning", action="store_true", help="start at the first offset instead of the end")
    p.add_argument("--max-messages", type=int, metavar="N", help="exit after N messages (or at the end, with --stop-at-end)")
    p.add_argument("--stop-at-end", action="store_true",
                   help="exit once every message that existed at start was read, instead of waiting for "
                        "more (with --from-beginning: print the whole topic and exit)")
    p.add_argument("--json", dest="as_json", action="store_true", help="whole messages as JSON (tensors summarized)")
    p.add_argument("--decode", metavar="TOKENIZER_PATH", help="show prompt and completion text")

    p = _tool(subparsers, "status", "offsets, lags, version and staleness budget on one screen", _status_command)
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="refresh period (default 2 s)")

    topics = subparsers.add_parser("topics", help="manage the trial's Kafka topics")
    actions = topics.add_subparsers(dest="topics_command", metavar="{create}", required=True)
    _tool(actions, "create", "create the trial's topics with the configured partitions and replication; grow "
                             "existing ones to kafka.partitions (all data topics together, a drained trial only)",
          _topics_create_command)


def _tool(subparsers: Any, name: str, help: str, func: Callable[[argparse.Namespace], int],
          role: bool = False) -> argparse.ArgumentParser:
    """The subcommand ``name`` with the config arguments (and the topic role, with ``role``), run by ``func``."""
    p = subparsers.add_parser(name, help=help)
    add_config_arguments(p)
    if role:
        p.add_argument("role", choices=ROLES, metavar="TOPIC_ROLE", help=" | ".join(ROLES))
    p.set_defaults(func=func)
    return p


def _load(args: argparse.Namespace, tool: str) -> RollstreamConfig | None:
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"rollstream {tool}: {exc}", file=sys.stderr)
        return None
    setup_logging(tool, config.log_level, secret_values(config), config.log_format)
    return config


def _run(args: argparse.Namespace, tool: str, body: Callable[[RollstreamConfig, asyncio.Event], Awaitable[int]]) -> int:
    """Load the configuration, then run ``body(config, stop)`` with SIGINT/SIGTERM setting
    ``stop`` (main thread only)."""
    config = _load(args, tool)
    if config is None:
        return 2

    async def main() -> int:
        shutdown = ShutdownSignal()
        if threading.current_thread() is threading.main_thread():
            shutdown.install()
        return await body(config, shutdown.event)

    try:
        return asyncio.run(main())
    except (ValueError, RuntimeError) as exc:  # ReplayError, missing topics, bad files
        print(f"rollstream {tool}: {exc}", file=sys.stderr)
        return 1
    except Exception:
        log.exception("%s failed", tool)
        return 1


def _replay_command(args: argparse.Namespace) -> int:
    from rollstream.tools.progress import replay_progress
    from rollstream.tools.replay import ReplayOptions, replay

    record_filter = RecordFilter(
        task_ids=frozenset(args.task_id), min_version=args.min_version, max_version=args.max_version,
        is_eval=args.is_eval, min_reward=args.min_reward, max_reward=args.max_reward,
    )
    try:
        options = ReplayOptions(
            offsets=parse_offset_specs(args.offset), since_ms=parse_since(args.since) if args.since else None,
            filter=record_filter, to_dump=args.to_dump, to_jsonl=args.to_jsonl, tensors=args.tensors,
            to_experiment=args.to_experiment, to_trial=args.to_trial, tokenizer_path=args.tokenizer,
            resume_file=args.resume_file, checkpoint_every=max(1, args.checkpoint_every), max_records=args.max_records,
        )
    except ValueError as exc:
        print(f"rollstream replay: {exc}", file=sys.stderr)
        return 2

    async def body(config: RollstreamConfig, stop: asyncio.Event) -> int:
        with replay_progress(enabled=not args.no_progress) as bar:
            stats = await replay(config, args.role, options, stop=stop, on_start=bar.start, progress=bar.advance)
        print(
            f"{stats.topic}: read {stats.read}, matched {stats.matched}, written {stats.written}, "
            f"undecodable {stats.undecodable}; {'complete' if stats.completed else 'stopped (resumable)'}",
            file=sys.stderr,
        )
        return 0 if stats.completed or args.max_records is not None else 130

    return _run(args, "replay", body)


def _tail_command(args: argparse.Namespace) -> int:
    from rollstream.tools.tail import TailOptions, tail

    options = TailOptions(
        from_beginning=args.from_beginning, max_messages=args.max_messages,
        as_json=args.as_json, tokenizer_path=args.decode, stop_at_end=args.stop_at_end,
    )

    async def body(config: RollstreamConfig, stop: asyncio.Event) -> int:
        with contextlib.suppress(BrokenPipeError):  # e.g. piped into `head`
            await tail(config, args.role, options, stop=stop)
        return 0

    return _run(args, "tail", body)


def _status_command(args: argparse.Namespace) -> int:
    from rollstream.tools.status import status

    async def body(config: RollstreamConfig, stop: asyncio.Event) -> int:
        await status(config, once=args.once, interval=args.interval, stop=stop)
        return 0

    return _run(args, "status", body)


def _topics_create_command(args: argparse.Namespace) -> int:
    from rollstream.tools.topic_admin import create_topics

    config = _load(args, "topics create")  # logs: the topic check's warnings, and waits for brokers
    if config is None:
        return 2
    try:
        report = asyncio.run(create_topics(config))
    except Exception as exc:  # a CLI answers with a message, not a traceback
        print(f"rollstream topics create: {exc}", file=sys.stderr)
        return 1
    for topic, (before, after) in report.grown.items():
        print(f"grew {topic}: {before} -> {after} partitions")
    print(f"topics ready ({config.kafka.partitions} partitions, replication {config.kafka.replication_factor}):")
    for topic in report.topics:
        print(f"  {topic}")
    return 0

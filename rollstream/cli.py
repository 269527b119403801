"""The ``rollstream`` command: one subcommand per tier plus the tools.

Tiers are discovered through the ``rollstream.tiers`` entry point group, so the core never
imports a tier package. A tier entry point names ``async def run(config, stop) -> None``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

from rollstream.config import ConfigError, RollstreamConfig, load_config, redacted, secret_values
from rollstream.runtime.health import HEALTH, heartbeat, mark_not_ready
from rollstream.runtime.logs import setup_logging
from rollstream.runtime.metrics import serve_metrics
from rollstream.runtime.shutdown import ShutdownSignal

log = logging.getLogger(__name__)

TierRun = Callable[[RollstreamConfig, asyncio.Event], Awaitable[None]]

TIER_HELP = {
    "producer": "publish prompts from a dataset, gated by the staleness budget",
    "rollout-worker": "run workflows on prompts and publish episodes",
    "reward-worker": "score episodes (transactional)",
    "grouping": "gather each prompt's samples into a group, pad it, and emit it on batches (transactional)",
    "dump": "write scored episodes as JSONL trajectory dumps",
}

# Tool subcommands that live in the core; each module exposes register(subparsers).
TOOL_MODULES = ("rollstream.dev.commands", "rollstream.tools.commands", "rollstream.demo.commands")


def _tier_entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group="rollstream.tiers")}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. --set rollout.max_concurrent_rollouts=8",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollstream", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, ep in sorted(_tier_entry_points().items()):
        tier = sub.add_parser(name, help=TIER_HELP.get(name, f"run the {name} tier"))
        add_config_arguments(tier)
        tier.set_defaults(func=_run_tier_command, tier=name, entry_point=ep)
    for module_name in TOOL_MODULES:
        try:
            module = import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register(sub)
    return parser


def _run_tier_command(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"rollstream {args.tier}: {exc}", file=sys.stderr)
        return 2
    run: TierRun = args.entry_point.load()
    return run_tier(args.tier, run, config)


def run_tier(tier: str, run: TierRun, config: RollstreamConfig) -> int:
    """Run one tier until it finishes or is signalled; returns the process exit code."""
    setup_logging(tier, config.log_level, secret_values(config), config.log_format)
    log.info("starting %s with config %s", tier, redacted(config))
    HEALTH.liveness_timeout = config.metrics.liveness_timeout_seconds
    serve_metrics(config.metrics.port)

    async def main() -> None:
        shutdown = ShutdownSignal()
        shutdown.install()
        probes = [asyncio.create_task(heartbeat(), name="heartbeat"),
                  asyncio.create_task(_not_ready_once_set(shutdown.event), name="stopping")]
        try:
            await run(config, shutdown.event)
        finally:
            for task in probes:
                task.cancel()

    try:
        asyncio.run(main())
    except Exception:
        log.exception("%s failed", tier)
        return 1
    log.info("%s stopped", tier)
    return 0


async def _not_ready_once_set(stop: asyncio.Event) -> None:
    await stop.wait()
    mark_not_ready("stopping")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""The ``rollstream`` command: one subcommand per tier plus the tools.

Tiers are discovered through the ``rollstream.tiers`` entry point group, so the core never
imports a tier package. A tier entry point names its declaration, ``declare(config) -> Tier``
(:mod:`rollstream.tier.declaration`); ``rollstream tier MODULE:NAME`` runs a tier of your own
that no package registers.
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
from rollstream.runtime.shutdown import SHUTDOWN_TIMEOUT_EXIT_CODE, ShutdownSignal
from rollstream.tier.declaration import Declare, Tier
from rollstream.tier.runtime import serve
from rollstream.tier.shutdown_bound import ShutdownTimeout

log = logging.getLogger(__name__)

TierServe = Callable[[Tier, RollstreamConfig, asyncio.Event], Awaitable[Any]]

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
    own = sub.add_parser("tier", help="run a tier of your own: MODULE:NAME names its declare(config) -> Tier")
    own.add_argument("declaration", metavar="MODULE:NAME")
    add_config_arguments(own)
    own.set_defaults(func=_run_tier_command, tier=None, entry_point=None)
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
    name = args.tier or args.declaration
    try:
        config = load_config(args.config, args.overrides)
        declare: Declare = args.entry_point.load() if args.entry_point else load_declaration(args.declaration)
        tier = declare(config)
    except ConfigError as exc:
        print(f"rollstream {name}: {exc}", file=sys.stderr)
        return 2
    return run_tier(tier, config)


def load_declaration(spec: str) -> Declare:
    """``"module:name"`` -> the declaration it names; ``ConfigError`` saying why not."""
    module_name, _, attr = spec.partition(":")
    try:
        declare = getattr(import_module(module_name), attr or "declare")
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load the tier declaration {spec!r}: {exc}") from None
    if not callable(declare):
        raise ConfigError(f"{spec!r} is not a function declare(config) -> Tier")
    return declare  # type: ignore[no-any-return]


def run_tier(tier: Tier, config: RollstreamConfig, run: TierServe = serve) -> int:
    """Run one tier (``run(tier, config, stop)``) until it finishes or is signalled; returns the
    process exit code: 0, 1 when it failed, 124 when its shutdown outran its bound."""
    setup_logging(tier.name, config.log_level, secret_values(config), config.log_format)
    log.info("starting %s with config %s", tier.label, redacted(config))
    HEALTH.liveness_timeout = config.metrics.liveness_timeout_seconds
    serve_metrics(config.metrics.port)

    async def main() -> None:
        shutdown = ShutdownSignal(exit_after=config.shutdown_timeout_seconds + tier.drain_seconds)
        shutdown.install()
        probes = [asyncio.create_task(heartbeat(), name="heartbeat"),
                  asyncio.create_task(_not_ready_once_set(shutdown.event), name="stopping")]
        try:
            await run(tier, config, shutdown.event)
        finally:
            shutdown.cancel()
            for task in probes:
                task.cancel()

    try:
        asyncio.run(main())
    except ShutdownTimeout as exc:
        log.error("%s", exc)
        return SHUTDOWN_TIMEOUT_EXIT_CODE
    except Exception:
        log.exception("%s failed", tier.label)
        return 1
    log.info("%s stopped", tier.label)
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

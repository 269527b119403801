"""Run one rollstream tier exactly as ``rollstream <tier>`` does, optionally with the LOAD
GENERATOR engine (``bench/load_engine.py``) in place of the configured model engine.

    python -m bench.tier_runner rollout-worker --config C.yaml --load-engine

The rollout worker builds its engine from ``rollout.engine`` (hf | sglang) and has no hook for
a custom engine, so ``--load-engine`` replaces ``rollout_workers.service.build_engine`` in this
process only (configured by the ``ROLLSTREAM_BENCH_*`` environment variables). Everything else —
config loading, logging, signals, the tier's ``run`` — is the production path.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from rollstream.cli import add_config_arguments, run_tier
from rollstream.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tier_runner", description=__doc__.splitlines()[0])
    parser.add_argument("tier")
    parser.add_argument("--load-engine", action="store_true", help="rollout-worker: use the load generator engine")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    tiers = {ep.name: ep for ep in entry_points(group="rollstream.tiers")}
    if args.tier not in tiers:
        parser.error(f"unknown tier {args.tier!r}; known: {', '.join(sorted(tiers))}")
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"bench tier {args.tier}: {exc}", file=sys.stderr)
        return 2
    run = tiers[args.tier].load()
    if args.load_engine:
        if args.tier != "rollout-worker":
            parser.error("--load-engine only applies to rollout-worker")
        import rollout_workers.service as service

        from bench.load_engine import LoadGeneratorEngine

        service.build_engine = lambda _config: LoadGeneratorEngine.from_env()  # type: ignore[assignment]
    return run_tier(args.tier, run, config)


if __name__ == "__main__":
    sys.exit(main())

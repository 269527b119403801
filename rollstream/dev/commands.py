"""`rollstream dev up | down | env`: a local Kafka broker and Redis for the demo and for poking at.

    eval "$(rollstream dev up)"     # start both (detached), export their addresses
    eval "$(rollstream dev up --brokers 3)"   # Kafka as a replicated 3-node cluster instead
    eval "$(rollstream dev up --vllm)"        # also a vLLM server (CPU) on the tiny model, or
                                              # --vllm MODEL_DIR; rollout workers use it (engine vllm)
    rollstream dev env              # print the export lines again
    rollstream dev down             # stop both and delete their data

State (pids, ports, logs, data) lives in `--state-dir`, by default `.rollstream/dev` under the
current directory.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from rollstream.dev.launcher import DevStateError, dev_down, dev_env, dev_up, export_lines
from rollstream.config import load_config
from rollstream.dev.vllm_server import dev_vllm_down, dev_vllm_env, dev_vllm_up

logger = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path(".rollstream") / "dev"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `dev` command; each leaf sets `func(args) -> int` (the exit code)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state-dir", type=Path, default=None,
        help=f"where pids, ports, logs and data live (default: ./{DEFAULT_STATE_DIR})",
    )
    dev = subparsers.add_parser("dev", help="run a local Kafka broker and Redis for development")
    actions = dev.add_subparsers(dest="dev_command", metavar="{up,down,env}", required=True)
    up = actions.add_parser("up", parents=[common], help="start both; print export lines")
    up.add_argument(
        "--brokers", type=int, default=1,
        help="Kafka nodes (default 1); 3 gives a replicated cluster: three controller voters, "
             "replication 3, min.insync.replicas 2 (set kafka.replication_factor: 3 for your topics)",
    )
    up.add_argument(
        "--vllm", nargs="?", const="", default=None, metavar="MODEL_DIR",
        help="also start a vLLM server (the environment scripts/setup.sh installs) on MODEL_DIR, default the "
             "tiny model; the export lines then point rollout workers at it (rollout.engine vllm)",
    )
    up.add_argument(
        "--config", type=Path, default=None,
        help="with --vllm: start it with this file's rollout.launch settings (dtype, batch, context, eager, "
             "tensor parallel, memory); ROLLSTREAM__ROLLOUT__LAUNCH__* variables override them",
    )
    up.set_defaults(func=_up)
    down = actions.add_parser("down", parents=[common], help="stop both and delete their data")
    down.set_defaults(func=_down)
    env = actions.add_parser("env", parents=[common], help="print export lines for running ones")
    env.set_defaults(func=_env)


def _state_dir(args: argparse.Namespace) -> Path:
    # resolved per call, not at import, so the default follows the caller's cwd
    return args.state_dir if args.state_dir is not None else Path.cwd() / DEFAULT_STATE_DIR


def _up(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    if args.brokers < 1:
        print(f"rollstream dev up: --brokers must be at least 1, not {args.brokers}", file=sys.stderr)
        return 2
    try:
        services = dev_up(state_dir, brokers=args.brokers)
        if args.vllm is not None:
            from rollstream.testing.tiny import tiny_model_dir

            print("# starting vLLM (30-60 s on CPU) ...", file=sys.stderr)
            launch = load_config(args.config).rollout.launch
            dev_vllm_up(state_dir, str(Path(args.vllm).resolve()) if args.vllm else str(tiny_model_dir()), launch)
    except Exception as exc:  # a CLI answers with a message, not a traceback
        print(f"rollstream dev up: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(export_lines(services) + dev_vllm_env(state_dir))
    print(f"# logs and data in {state_dir}; stop with `rollstream dev down`", file=sys.stderr)
    return 0


def _down(args: argparse.Namespace) -> int:
    try:
        stopped = dev_vllm_down(_state_dir(args))
        stopped = dev_down(_state_dir(args)) or stopped
    except DevStateError as exc:
        print(f"rollstream dev down: {exc}", file=sys.stderr)
        return 1
    print("stopped" if stopped else "nothing was running", file=sys.stderr)
    return 0


def _env(args: argparse.Namespace) -> int:
    try:
        sys.stdout.write(dev_env(_state_dir(args)) + dev_vllm_env(_state_dir(args)))
    except DevStateError as exc:
        print(f"rollstream dev env: {exc}", file=sys.stderr)
        return 1
    return 0

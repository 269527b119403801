"""Chaos: a seeded fault schedule on a 3-node cluster, every invariant checked.

    python -m bench.chaos --minutes 30 --seed 20261201     # the target: >= 60 faults, 0 violations
    python -m bench.chaos --quick                          # 2 minutes, a fault every 10 s or so
    python -m bench.chaos --engine vllm --minutes 30       # on a real vLLM server, the weight path's faults too

On this machine: a local 3-node KRaft cluster (``rollstream.dev.cluster``), a redis-server with
an append-only file, and as processes: 2 producers, 2 to 4 rollout workers (the HF engine on
the tiny offline model), 2 reward workers, 2 grouping instances and the example GRPO trainer
(``rollstream train``). The faults (``bench/chaos/schedule.py``): SIGKILL and SIGSTOP of any
instance, the trainer included; broker nodes killed, restarted and paused; Redis restarted with
its data and without; rollout workers joining, leaving and restarting with their worker id; the
trainer publishes a version every step all along. With ``--engine vllm`` the rollout workers
generate on one real vLLM server (versions over the wire, a checkpoint each) and three more
kinds are drawn: the server's sync owner SIGSTOPped as it starts a load, past its lease;
the server SIGKILLed in a load (and started again); the owner SIGKILLed; at the end every
generated token on ``batches`` is audited by its logprob against its version's weights.
Checked while it runs and at the end
(``bench/chaos/invariants.py``): every admitted prompt ends exactly once, no group is trained
twice, the staleness bound, versions only go up, every token's version within its batch's
bounds, nothing left in flight. Prints the faults by kind and every violation with what it saw;
exits 1 on any violation (or when fewer than 2 faults a minute were carried out).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

from bench.chaos.report import FOREIGN_ENV, report
from bench.chaos.run import Settings, run_chaos
from bench.common import Report, base_parser
from harness.services import tokenizer_path


DEFAULT_SEED = 20261201


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("chaos", __doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=None, help="length of the fault phase (default 30, quick 2)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"draws the schedule (default {DEFAULT_SEED})")
    parser.add_argument("--mean-gap", type=float, default=None, help="seconds between faults (default 22, quick 10)")
    parser.add_argument("--model", type=Path, default=None, help="the tiny model (default: built in the cache)")
    parser.add_argument("--workdir", type=Path, default=None, help="logs, cluster and Redis data (kept)")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="where the rollout workers generate: hf (in process) or vllm (one real server, and the "
                             "weight path's faults)")
    args = parser.parse_args(argv)
    minutes = args.minutes if args.minutes is not None else (2.0 if args.quick else 30.0)
    gap = args.mean_gap if args.mean_gap is not None else (10.0 if args.quick else 22.0)
    settings = Settings(minutes=minutes, seed=args.seed, mean_gap=gap, engine=args.engine)
    for name in [*FOREIGN_ENV, *(k for k in os.environ if k.startswith("ROLLSTREAM__"))]:
        os.environ.pop(name, None)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir {workdir} (tier logs in {workdir / 'logs'})", flush=True)
    out = Report("chaos", args.quick)  # now: the load average at the start is the run's
    result = asyncio.run(run_chaos(settings, workdir.resolve(), args.model or tokenizer_path()))
    report(result, out)
    status = out.finish(args.out)
    if status == 0 and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)  # kept when something failed: the logs tell why
    return status


if __name__ == "__main__":
    raise SystemExit(main())

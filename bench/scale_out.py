"""Scale-out under load: tiers grown and shrunk while the pipeline runs; throughput per replica count.

The real tiers, each replica its own process (``rollstream <tier>``), on the LOAD GENERATOR
engine (``bench/load_engine.py``) rate-limited PER rollout worker (``--tokens-per-second``, as
one GPU per worker would be), so one rollout worker is the bottleneck at the start. This
process plays a fast trainer: it publishes weight versions so that the staleness budget always
admits ``--backlog`` prompts beyond those ended (work is always waiting, and little is left to
drain at the end). Phases of ``--phase-seconds`` follow:

    1/1/1 -> rollout 4 -> reward 3 -> grouping 3 -> back to 1/1/1   (rollout/reward/grouping)

A replica joins as a new process (it takes partitions in its consumer group's rebalance) and
leaves with SIGTERM (it finishes in-flight work, commits and leaves the group). Per phase:
groups/s over the window from every new replica consuming to the phase's end, and the
transition (start-up and rebalance) separately. Then versions stop, the producer stops, and the
pipeline drains. The accounting is read from the topics (read_committed,
``harness.ledger``): every admitted prompt ended exactly once, as an emitted group or a
counted drop; no row twice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import Report, run_bench
from bench.load_engine import ENV_MIN_SHARE, ENV_RATE, ENV_VOCAB
from bench.pipeline_run import PipelineSettings, config_tree
from harness.configs import write_config
from harness.ledger import BatchesWatcher, read_topic
from harness.services import unique_name
from harness.tiers import TierProcess, stop_all, wait_until_consuming
from harness.waits import stop_task
from rollstream.api.engine import WeightUpdate
from rollstream.config import RollstreamConfig, config_from_dict
from rollstream.dev.launcher import dev_stack
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.topics import TopicNames
from rollstream.state.client import RedisKeys, connect
from rollstream.state.version_store import VersionStore
from rollstream.wire import decode_prompt


TIERS = ("rollout-worker", "reward-worker", "grouping")
ID_SETTING = {"rollout-worker": "ROLLOUT__WORKER_ID", "reward-worker": "REWARD__WORKER_ID",
              "grouping": "GROUPING__INSTANCE_ID"}
PHASES: list[tuple[str, dict[str, int]]] = [
    ("1/1/1", {"rollout-worker": 1, "reward-worker": 1, "grouping": 1}),
    ("rollout 4", {"rollout-worker": 4, "reward-worker": 1, "grouping": 1}),
    ("reward 3", {"rollout-worker": 4, "reward-worker": 3, "grouping": 1}),
    ("grouping 3", {"rollout-worker": 4, "reward-worker": 3, "grouping": 3}),
    ("back to 1/1/1", {"rollout-worker": 1, "reward-worker": 1, "grouping": 1}),
]


def capped_phases(most: int) -> list[tuple[str, dict[str, int]]]:
    """PHASES with at most ``most`` replicas of any tier (``--max-replicas``; 0: PHASES as they are)."""
    if most <= 0:
        return PHASES
    phases = []
    for name, counts in PHASES:
        word, _, number = name.rpartition(" ")
        phases.append((f"{word} {min(int(number), most)}" if number.isdigit() else name,
                       {tier: min(count, most) for tier, count in counts.items()}))
    return phases


@dataclass
class PhaseResult:
    name: str
    replicas: dict[str, int]
    transition_seconds: float  # from the change to every new replica consuming
    seconds: float  # measured window
    groups: int  # ended in the window
    ended_in_transition: int

    def row(self, group_size: int, tokens_per_group: int, rate: float) -> dict[str, Any]:
        per_second = self.groups / self.seconds if self.seconds > 0 else float("nan")
        ceiling = self.replicas["rollout-worker"] * rate / tokens_per_group if rate > 0 else float("nan")
        return {
            "phase": self.name,
            "rollout/reward/grouping": "/".join(str(self.replicas[t]) for t in TIERS),
            "groups/s": per_second, "episodes/s": per_second * group_size,
            "generated tokens/s": per_second * tokens_per_group,
            "load generator ceiling groups/s": ceiling,
            "window s": self.seconds, "groups in window": self.groups,
            "transition s": self.transition_seconds, "groups in transition": self.ended_in_transition,
        }


@dataclass
class Replicas:
    """The running replicas of every tier; grows and shrinks them."""

    path: Path
    workdir: Path
    env: dict[str, str]
    running: dict[str, list[TierProcess]] = field(default_factory=lambda: {t: [] for t in TIERS})
    stopped: list[TierProcess] = field(default_factory=list)
    started: int = 0

    def scale(self, tier: str, count: int) -> list[TierProcess]:
        """Start or stop replicas of ``tier`` until ``count`` run; returns the new ones."""
        procs = self.running[tier]
        new = []
        while len(procs) < count:
            index = self.started
            self.started += 1
            env = {**self.env, f"ROLLSTREAM__{ID_SETTING[tier]}": f"bench-{tier}-{index}"}
            new.append(TierProcess(tier, self.path, self.workdir / f"{tier}-{index}.log", env=env).start())
            procs.append(new[-1])
        leaving = procs[count:]
        del procs[count:]
        for proc in leaving:
            proc.signal_stop()  # SIGTERM: finish in-flight work, commit, leave the group
        for proc in leaving:
            code = proc.stop(60)
            if code != 0:
                raise RuntimeError(f"{proc.tier} left with exit code {code}: {proc.log_path}")
        self.stopped += leaving
        return new

    def all(self) -> list[TierProcess]:
        return [p for procs in self.running.values() for p in procs]

    def check(self) -> None:
        for proc in self.all():
            proc.check_alive()
            if not proc.running():
                raise RuntimeError(f"{proc.tier} ended unasked: {proc.log_path}")


async def run_phases(watcher: BatchesWatcher, replicas: Replicas, phase_seconds: float,
                     timeout: float, phases: list[tuple[str, dict[str, int]]]) -> list[PhaseResult]:
    results = []
    for name, counts in phases:
        changed = time.monotonic()
        before = len(watcher.ledger.accounted)
        new = [p for tier in TIERS for p in await asyncio.to_thread(replicas.scale, tier, counts[tier])]
        await wait_until_consuming(new, timeout)
        began = time.monotonic()
        at_start = len(watcher.ledger.accounted)
        while time.monotonic() - began < phase_seconds:
            replicas.check()
            watcher.check_alive()
            await asyncio.sleep(0.1)
        ended = len(watcher.ledger.accounted)
        results.append(PhaseResult(name, dict(counts), began - changed, time.monotonic() - began,
                                   ended - at_start, at_start - before))
        print(f"phase {name}: {ended - at_start} groups in {time.monotonic() - began:.1f}s "
              f"(transition {began - changed:.1f}s, {at_start - before} groups)", flush=True)
    return results


async def pace(config: RollstreamConfig, watcher: BatchesWatcher, backlog: int, weights: str) -> None:
    """The fast trainer: keep the staleness budget ``backlog`` prompts ahead of the groups ended."""
    exp, groups_per_step = config.experiment, config.staleness.groups_per_step
    redis = connect(config.redis)
    store = VersionStore(redis, RedisKeys(exp.experiment_name, exp.trial_name))
    version = 0
    try:
        while True:
            # capacity (version + 1) * groups_per_step (eta 0) >= ended + backlog
            wanted = max(0, -(-(len(watcher.ledger.accounted) + backlog) // groups_per_step) - 1)
            if wanted > version:
                version = wanted
                await store.publish(WeightUpdate(version, weights))
            await asyncio.sleep(0.1)
    finally:
        await redis.aclose()


async def first_group(watcher: BatchesWatcher, replicas: Replicas, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not watcher.ledger.accounted:
        replicas.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no group ended within {timeout:.0f}s of the producer's start")
        await asyncio.sleep(0.1)


async def drain(watcher: BatchesWatcher, replicas: Replicas, config: RollstreamConfig, names: TopicNames,
                timeout: float) -> tuple[set[str], float]:
    """Wait until every admitted prompt ended; returns the admitted task ids and the seconds."""
    began = time.monotonic()
    admitted = {p.task_id for p in await read_topic(config.kafka, names.prompts, decode_prompt)}
    while not admitted <= watcher.ledger.accounted:
        replicas.check()
        if time.monotonic() - began > timeout:
            raise TimeoutError(f"{len(admitted - watcher.ledger.accounted)} admitted prompts still open")
        await asyncio.sleep(0.2)
    return admitted, time.monotonic() - began


async def measure(args: argparse.Namespace, report: Report) -> None:
    phase_seconds = args.phase_seconds or (4.0 if args.quick else 30.0)
    settings = PipelineSettings(prompts=args.prompts, group_size=args.group_size, prompt_tokens=args.prompt_tokens,
                                completion_tokens=args.completion_tokens, partitions=4,
                                max_concurrent_rollouts=args.max_concurrent_rollouts,
                                tokens_per_second=args.tokens_per_second)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollstream-scale-")))
        workdir.mkdir(parents=True, exist_ok=True)
        dev = stack.enter_context(dev_stack(workdir / "services", brokers=args.brokers))
        name = unique_name("scale")
        tree = config_tree(dev.services, name, workdir, settings)
        tree["kafka"]["replication_factor"] = dev.services.replication
        tree["staleness"] = {"enabled": True, "groups_per_step": 8, "max_head_offpolicyness": 0}
        tree["producer"].update(admission_poll_seconds=0.1, max_batch_prompts=16)
        tree["reward"]["max_workers"] = 1  # up to ten tier processes here: one reward pool process each
        path = write_config(workdir / f"{name}.yaml", tree)
        config = config_from_dict(tree)
        names = TopicNames(name, "t0")
        await ensure_topics(config.kafka, names)
        env = {ENV_RATE: str(args.tokens_per_second), ENV_MIN_SHARE: "1", ENV_VOCAB: str(settings.vocab_size)}
        replicas = Replicas(path, workdir, env)
        watcher = BatchesWatcher(config.kafka, names.batches)
        await watcher.__aenter__()
        producer: TierProcess | None = None
        pacer = asyncio.create_task(pace(config, watcher, args.backlog, tree["rollout"]["model_path"]))
        began = time.monotonic()
        try:
            for tier in reversed(TIERS):  # consumers first
                replicas.scale(tier, 1)
            await wait_until_consuming(replicas.all(), args.timeout)
            producer = TierProcess("producer", path, workdir / "producer.log").start()
            await first_group(watcher, replicas, args.timeout)  # the first phase measures a running pipeline
            results = await run_phases(watcher, replicas, phase_seconds, args.timeout,
                                       capped_phases(args.max_replicas))
            pacer.cancel()
            producer.stop(60)  # commits what it admitted
            admitted, drain_seconds = await drain(watcher, replicas, config, names, args.timeout)
        finally:
            await stop_task(pacer, "the stand-in trainer")
            stop_all(replicas.all() + ([producer] if producer else []))
            await watcher.__aexit__()
        problems = watcher.ledger.check(admitted)
    tokens_per_group = args.group_size * args.completion_tokens
    rows = [r.row(args.group_size, tokens_per_group, args.tokens_per_second) for r in results]
    report.table(f"Throughput per replica count: groups of {args.group_size}, prompt {args.prompt_tokens} + completion "
                 f"{args.completion_tokens} tokens, load generator {args.tokens_per_second:,.0f} tokens/s per rollout "
                 f"worker, {args.brokers} broker(s), 4 partitions, {args.backlog} prompts admitted ahead", rows)
    ledger = watcher.ledger
    report.table("Accounting (read from the topics, read_committed)", [{
        "admitted": len(admitted), "emitted": len(ledger.emitted), "dropped": sum(ledger.drop_reasons.values()),
        "duplicate tasks": len(ledger.duplicate_tasks()), "duplicate rows": len(ledger.duplicate_rows()),
        "lost": len(admitted - ledger.accounted), "problems": "; ".join(problems) or "none",
        "replicas started": replicas.started, "drain s": drain_seconds, "total s": time.monotonic() - began}])
    report.note("every tier replica, the broker(s) and Redis share this machine's cores: past the CPU they "
                "have, more replicas add processes, not throughput (see the machine line)")
    report.extra.update(problems=problems, admitted=len(admitted), phase_seconds=phase_seconds,
                        brokers=args.brokers, drops=dict(ledger.drop_reasons))
    if problems:
        raise SystemExit("accounting broken:\n" + "\n".join(problems))


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--phase-seconds", type=float, default=None, help="measured seconds per phase (default 30; --quick 4)")
    parser.add_argument("--backlog", type=int, default=64, help="prompts admitted beyond those ended (default 64)")
    parser.add_argument("--prompts", type=int, default=20000, help="dataset rows (more than a run can use)")
    parser.add_argument("--tokens-per-second", type=float, default=12000.0,
                        help="load generator rate PER rollout worker (default 12,000; 0: unlimited)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--completion-tokens", type=int, default=256)
    parser.add_argument("--max-concurrent-rollouts", type=int, default=64)
    parser.add_argument("--brokers", type=int, default=1, help="local Kafka nodes (3: a replicated cluster)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any one phase may take")
    parser.add_argument("--workdir", type=Path, default=None, help="keep configs, tier logs and services here")
    parser.add_argument("--max-replicas", type=int, default=0,
                        help="at most this many replicas of a tier in any phase (default 0: no cap, up to 4 "
                             "rollout workers)")


def main(argv: list[str] | None = None) -> int:
    return run_bench("scale_out", __doc__, arguments, measure, argv)


if __name__ == "__main__":
    sys.exit(main())

"""An elastic rollout fleet: what a worker joining, leaving, restarting and crashing costs.

Every worker is its own ``rollstream rollout-worker`` process on the LOAD GENERATOR engine
(``bench/load_engine.py``: tokens at a fixed rate per worker, like a GPU's aggregate rate), a
producer keeps a backlog of prompts (staleness off), and nothing downstream runs: the
measure is the ``episodes`` topic itself. The schedule, one phase each (``--phase-seconds``):

    start     two workers (w1, w2)
    join      w3 starts
    leave     w2 gets SIGTERM (graceful: it leaves the group, finishes what it runs)
    restart   w1 gets SIGTERM and starts again with the same worker id
    crash     w3 gets SIGKILL
    end       everything stops

Per transition it prints: prompts generated again (a prompt that a worker started running
after another had started it: the workers' logs), the samples published twice and their
tokens as a share of all tokens of the run (the ``episodes`` topic), the
longest time any prompt partition had no live partition owner (from the workers' JSON logs: assigned /
revoked / left the consumer group, and the kill), and for a worker that starts, the time from its first
"consuming" line (engine loaded) to its first prompt. For the crash it also gives the dead
worker's prompts in flight at the kill (started, not all samples published). Targets: no
re-runs for join, leave and restart; crash re-runs equal to the dead worker's in-flight
prompts; duplicate tokens at most 1% of the run.

    python -m bench.elastic                  # the default schedule, about 6 minutes
    python -m bench.elastic --quick          # a smoke run
    python -m bench.elastic --redis-pause-at-join 20   # Redis frozen (SIGSTOP) for 20 s from just
                                                       # before w3 starts (needs the local redis-server)
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import Report, base_parser
from bench.load_engine import ENV_RATE
from harness.configs import pipeline_config, write_config
from harness.services import services, tokenizer_path, unique_name
from harness.tiers import TierProcess, stop_all, tail
from rollstream.config import config_from_dict
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.scan import scan_topic
from rollstream.kafka.topics import TopicNames
from rollstream.wire import Episode, decode_episode
from rollstream.wire.tensor_codec import decode_array


TRANSITIONS = ("join", "leave", "restart", "crash")


@dataclass
class Sizes:
    phase_seconds: float
    tokens_per_second: float  # per worker
    max_new_tokens: int
    group_size: int = 8
    partitions: int = 8
    max_concurrent: int = 16
    failure_detection: float = 10.0
    redis_pause_at_join: float = 0.0  # seconds Redis is frozen from just before w3 starts (0: never)


@dataclass
class Worker:
    """One worker id and its processes (a restart is a second process with the same id)."""

    worker_id: str
    log_path: Path
    processes: list[TierProcess] = field(default_factory=list)
    killed_at: float | None = None

    @property
    def process(self) -> TierProcess:
        return self.processes[-1]


class Fleet:
    def __init__(self, config_path: Path, workdir: Path, sizes: Sizes) -> None:
        self.config_path = config_path
        self.workdir = workdir
        self.sizes = sizes
        self.workers: dict[str, Worker] = {}
        self.events: list[tuple[str, float]] = []  # (transition, wall time)

    def start(self, worker_id: str) -> TierProcess:
        worker = self.workers.setdefault(worker_id, Worker(worker_id, self.workdir / f"{worker_id}.log"))
        env = {"ROLLSTREAM__ROLLOUT__WORKER_ID": worker_id, ENV_RATE: str(self.sizes.tokens_per_second)}
        process = TierProcess("rollout-worker", self.config_path, worker.log_path, env=env).start()
        worker.processes.append(process)
        return process

    def mark(self, transition: str) -> None:
        self.events.append((transition, time.time()))
        print(f"{time.strftime('%H:%M:%S')} {transition}", flush=True)

    async def stop_gracefully(self, worker_id: str) -> None:
        process = self.workers[worker_id].process
        process.signal_stop()
        code = await asyncio.to_thread(process.stop, 120.0)
        if code != 0:
            raise RuntimeError(f"{worker_id} exited with {code} on SIGTERM:\n{tail(process.log_path)}")

    def kill(self, worker_id: str) -> None:
        worker = self.workers[worker_id]
        worker.process.kill()
        worker.killed_at = time.time()

    def all_processes(self) -> list[TierProcess]:
        return [p for w in self.workers.values() for p in w.processes]


async def run_schedule(fleet: Fleet, sizes: Sizes, redis: Any = None) -> None:
    phase = sizes.phase_seconds
    fleet.mark("start")
    fleet.start("w1")
    fleet.start("w2")
    await asyncio.sleep(phase)
    fleet.mark("join")
    paused = min(sizes.redis_pause_at_join, phase)
    if paused:
        redis.pause()  # the workers' liveness keys expire while it is frozen (its clock runs on)
    fleet.start("w3")
    if paused:
        await asyncio.sleep(paused)
        redis.resume()
    await asyncio.sleep(phase - paused)
    fleet.mark("leave")
    await fleet.stop_gracefully("w2")
    await asyncio.sleep(phase)
    fleet.mark("restart")
    await fleet.stop_gracefully("w1")
    fleet.start("w1")
    await asyncio.sleep(phase)
    fleet.mark("crash")
    fleet.kill("w3")
    await asyncio.sleep(phase + sizes.failure_detection)
    fleet.mark("end")


# -- reading what happened --


@dataclass
class Sample:
    task_id: str
    sample_idx: int
    tokens: int
    at: float  # the record's timestamp (seconds)


async def read_samples(config: Any, names: TopicNames) -> list[Sample]:
    samples: list[Sample] = []
    async for record in scan_topic(config.kafka, names.episodes, "bench-elastic-reader"):
        message = decode_episode(record.value)
        if isinstance(message, Episode):
            tokens = int(decode_array(message.trajectory["loss_mask"]).sum())
            samples.append(Sample(message.task_id, message.sample_idx, tokens, record.timestamp / 1000))
    return samples


def log_lines(path: Path) -> list[tuple[float, str]]:
    """(time, message) of every JSON log line of a worker (both processes of a restart)."""
    lines: list[tuple[float, str]] = []
    for raw in path.read_text(errors="replace").splitlines():
        if not raw.startswith("{"):
            continue
        try:
            entry = json.loads(raw)
        except json.JSONDecodeError:
            continue
        lines.append((datetime.fromisoformat(entry["time"]).timestamp(), entry["message"]))
    return lines


def ownership_intervals(worker: Worker, end: float) -> dict[int, list[tuple[float, float]]]:
    """Per partition, the intervals in which this worker owned it (alive)."""
    owned: dict[int, float] = {}
    intervals: dict[int, list[tuple[float, float]]] = defaultdict(list)

    def close(at: float, partitions: list[int] | None = None) -> None:
        for p in list(owned) if partitions is None else partitions:
            if p in owned:
                intervals[p].append((owned.pop(p), at))

    for at, message in log_lines(worker.log_path):
        if "assigned partitions" in message:
            close(at)
            owned.update(dict.fromkeys(_partitions(message), at))
        elif "revoked partitions" in message and ": revoked" in message:
            close(at, _partitions(message))
        elif message.startswith("left the consumer group") or message.startswith("rollout-worker") and message.endswith(" stopped"):
            close(at)
    close(worker.killed_at or end)
    return intervals


def _partitions(message: str) -> list[int]:
    inside = message[message.index("[") + 1:message.index("]")] if "[" in message else ""
    return [int(p) for p in inside.split(",") if p.strip().isdigit()]


def longest_unserved(fleet: Fleet, start: float, stop: float, partitions: int) -> float:
    """The longest stretch in [start, stop) during which some partition had no live partition owner."""
    covered: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for worker in fleet.workers.values():
        for p, spans in ownership_intervals(worker, stop).items():
            covered[p] += spans
    worst = 0.0
    for p in range(partitions):
        cursor = start
        for begin, end in sorted(covered[p]):
            if end <= cursor:
                continue
            if begin > cursor:
                worst = max(worst, min(begin, stop) - cursor)
            cursor = max(cursor, end)
            if cursor >= stop:
                break
        worst = max(worst, stop - cursor) if cursor < stop else worst
    return worst


def first_prompt_delay(worker: Worker, after: float) -> float:
    """Seconds from the worker's first "consuming" line after ``after`` to its first prompt."""
    ready = None
    for at, message in log_lines(worker.log_path):
        if at < after:
            continue
        if ready is None and " consuming " in message:
            ready = at
        elif ready is not None and "running" in message and "samples with workflow" in message:
            return at - ready
    return float("nan")


def in_flight_at_kill(worker: Worker) -> int:
    started: set[str] = set()
    for at, message in log_lines(worker.log_path):
        if worker.killed_at is not None and at > worker.killed_at:
            break
        if "samples with workflow" in message:
            started.add(message.split()[1].rstrip(":"))
        elif "samples published" in message:
            started.discard(message.split()[1].rstrip(":"))
    return len(started)


def prompt_starts(fleet: Fleet) -> dict[str, list[float]]:
    """task id -> the times any worker started running it (its "running N samples" lines)."""
    starts: dict[str, list[float]] = defaultdict(list)
    for worker in fleet.workers.values():
        for at, message in log_lines(worker.log_path):
            if "samples with workflow" in message:
                starts[message.split()[1].rstrip(":")].append(at)
    return starts


def analyse(fleet: Fleet, samples: list[Sample], sizes: Sizes, report: Report) -> None:
    events = dict(fleet.events)
    bounds = [(name, events[name], events[nxt]) for name, nxt in zip(("start", *TRANSITIONS), (*TRANSITIONS, "end"))]
    again = [at for times in prompt_starts(fleet).values() for at in sorted(times)[1:]]  # second and later starts
    copies: dict[tuple[str, int], list[Sample]] = defaultdict(list)
    for sample in sorted(samples, key=lambda s: s.at):
        copies[(sample.task_id, sample.sample_idx)].append(sample)
    total_tokens = sum(s.tokens for s in samples)
    rows, duplicate_tokens = [], 0
    for name, start, stop in bounds:
        extra = [s for group in copies.values() for s in group[1:] if start <= s.at < stop]
        tokens = sum(s.tokens for s in extra)
        duplicate_tokens += tokens
        row: dict[str, Any] = {
            "transition": name,
            "at (s)": round(start - events["start"], 1),
            "prompts re-run": sum(start <= at < stop for at in again),
            "duplicate samples": len(extra),
            "duplicate tokens (% of run)": 100.0 * tokens / total_tokens if total_tokens else 0.0,
            # the start phase's first assignment is not a transition's cost
            "longest unserved partition (s)": (
                float("nan") if name == "start" else longest_unserved(fleet, start, stop, sizes.partitions)
            ),
        }
        if name == "join":
            row["new worker: start -> first prompt (s)"] = first_prompt_delay(fleet.workers["w3"], start)
        if name == "restart":
            row["new worker: start -> first prompt (s)"] = first_prompt_delay(fleet.workers["w1"], start)
        if name == "crash":
            row["dead worker's prompts in flight"] = in_flight_at_kill(fleet.workers["w3"])
        rows.append(row)
    report.table("Per transition (prompts re-run, duplicate tokens, unserved time)", rows)
    by_name = {r["transition"]: r for r in rows}
    share = 100.0 * duplicate_tokens / total_tokens if total_tokens else float("nan")
    report.extra.update({"samples": len(samples), "distinct samples": len(copies), "tokens": total_tokens,
                         "duplicate tokens (% of run)": share})
    print(f"\n{len(samples)} samples published for {len(copies)} distinct; {total_tokens:,} tokens, "
          f"{share:.2f}% of them duplicates")
    for name in ("join", "leave", "restart"):
        report.target(f"prompts re-run on {name}", by_name[name]["prompts re-run"], 0, higher_is_better=False)
    crash = by_name["crash"]
    report.target("crash re-runs beyond the dead worker's in-flight prompts",
                  crash["prompts re-run"] - crash["dead worker's prompts in flight"], 0, higher_is_better=False)
    report.target("duplicate tokens, % of the run", share, 1.0, higher_is_better=False, unit="%")


def config_tree(name: str, dev: Any, dataset: Path, sizes: Sizes) -> dict[str, Any]:
    return pipeline_config(
        dev.services.kafka_bootstrap, dev.services.redis_url, name, kafka={"partitions": sizes.partitions},
        log_format="json",
        staleness={"enabled": False},
        producer={"dataset": str(dataset), "group_size": sizes.group_size, "producer_id": "bench"},
        rollout={
            "engine": "custom", "engine_factory": "bench.load_engine:make_engine",
            "tokenizer_path": str(tokenizer_path()),
            "max_concurrent_rollouts": sizes.max_concurrent,
            "failure_detection_seconds": sizes.failure_detection,
            "gconfig": {"max_new_tokens": sizes.max_new_tokens},
        },
    )


async def measure(sizes: Sizes, report: Report) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp, services(Path(tmp) / "services") as dev:
        workdir = Path(tmp)
        name = unique_name("elastic")
        dataset = workdir / "prompts.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n"
                                   for i in range(5000)))
        tree = config_tree(name, dev, dataset, sizes)
        config = config_from_dict(tree)
        names = TopicNames(name, "t0")
        await ensure_topics(config.kafka, names)
        config_path = write_config(workdir / "elastic.yaml", tree)
        producer = TierProcess("producer", config_path, workdir / "producer.log").start()
        fleet = Fleet(config_path, workdir, sizes)
        if sizes.redis_pause_at_join and dev.redis is None:
            raise SystemExit("--redis-pause-at-join needs the local redis-server (unset REDIS_URL)")
        try:
            await run_schedule(fleet, sizes, dev.redis)
        finally:
            stop_all([producer, *fleet.all_processes()], timeout=60.0)
        samples = await read_samples(config, names)
        analyse(fleet, samples, sizes, report)
        if os.environ.get("ROLLSTREAM_BENCH_KEEP_LOGS"):
            for worker in fleet.workers.values():
                print(f"--- {worker.worker_id}\n{tail(worker.log_path, 400)}")


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("elastic", __doc__.splitlines()[0])
    parser.add_argument("--phase-seconds", type=float, default=None, help="length of each phase (default 60, quick 20)")
    parser.add_argument("--redis-pause-at-join", type=float, default=0.0,
                        help="freeze Redis (SIGSTOP) this many seconds from just before the third worker starts")
    parser.add_argument("--tokens-per-second", type=float, default=512.0,
                        help="load generator rate PER worker (default 512; higher: a worker stops sooner on SIGTERM)")
    parser.add_argument("--failure-detection", type=float, default=10.0,
                        help="rollout.failure_detection_seconds (default 10; the broker's least is 6): the crash phase "
                             "lasts this much longer")
    args = parser.parse_args(argv)
    sizes = Sizes(phase_seconds=args.phase_seconds or (20.0 if args.quick else 60.0),
                  tokens_per_second=args.tokens_per_second, max_new_tokens=192 if not args.quick else 96,
                  failure_detection=args.failure_detection, redis_pause_at_join=args.redis_pause_at_join)
    report = Report("elastic", args.quick)
    report.extra["sizes"] = sizes.__dict__
    asyncio.run(measure(sizes, report))
    return report.finish(args.out)


if __name__ == "__main__":
    raise SystemExit(main())

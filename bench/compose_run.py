"""The compose deployment, run for real: ``docker compose up``, train, restart tiers, check the
accounting from the topics, ``docker compose down``.

It brings up compose.yaml's ``cpu`` profile with the demo's config (``deploy/rollstream-cpu.yaml``:
the tiny model and the one-digit sums) under a project of its own, waits until the example
trainer published ``--steps`` weight versions, stops and starts each ``--restart`` tier
(``docker compose stop`` / ``start``: SIGTERM, then the same container again) while the run goes
on, runs ``rollstream status`` in a container, then stops the producer, waits until every
admitted prompt has ended, and checks from the topics that each ended exactly once (one emitted
group or one counted drop, no sample twice: ``harness.ledger``). ``down -v`` at the end,
whatever happened (``--keep``: leave it up).

The images must exist (``bash scripts/images.sh``). Containers talk to each other on the
project's network; this script reads Kafka and Redis through ports published on 127.0.0.1 only.

    python -m bench.compose_run                          # 5 steps, the rollout worker and grouping restarted
    python -m bench.compose_run --steps 3 --restart trainer
    python -m bench.compose_run --monitoring             # + Prometheus: every tier scraped
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from redis.exceptions import RedisError

from bench.common import Report, base_parser
from harness.ledger import BatchesWatcher, read_topic
from rollstream.config import RollstreamConfig, load_config
from rollstream.dev.processes import free_port
from rollstream.kafka.topics import TopicNames
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys, connect
from rollstream.state.version_store import VersionStore
from rollstream.wire import decode_dead_letter, decode_prompt


ROOT = Path(__file__).resolve().parents[1]
CONFIG = "rollstream-cpu.yaml"
TIERS = ("producer", "rollout-worker-cpu", "reward-worker", "grouping", "dump", "trainer")
STATUS_TIERS = ("producer", "rollout-worker", "reward-worker", "grouping", "dump", "trainer")
NOT_BUILT_HERE = ("grafana",)  # pulled images no local base builds (docs/DEPLOYMENT.md)
STEP_LINE = re.compile(r"step (\d+): version (\d+), reward ([0-9.]+) over (\d+) episodes")
# the operator's own services must not leak into the stack's containers through compose's ${...}
SCRUBBED = ("ROLLSTREAM", "KAFKA", "REDIS", "COMPOSE", "BASE_IMAGE", "PUBLISH_ADDRESS")


class ComposeRunError(RuntimeError):
    """The deployment did not do what it must; the message says what, with the logs' ends."""


def compose_cli() -> list[str]:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise ComposeRunError("neither the docker compose plugin nor docker-compose is installed")


@dataclass
class Compose:
    """``docker compose`` on this repository's compose.yaml, one project, fixed profiles and
    environment."""

    project: str
    profiles: list[str]
    env: dict[str, str]
    cli: list[str] = field(default_factory=compose_cli)
    _containers: dict[str, str] = field(default_factory=dict)

    def argv(self, *args: str) -> list[str]:
        profiles = [arg for p in self.profiles for arg in ("--profile", p)]
        return [*self.cli, "-p", self.project, "-f", str(ROOT / "compose.yaml"), *profiles, *args]

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> str:
        done = subprocess.run(self.argv(*args), cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise ComposeRunError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return done.stdout

    def services(self) -> list[str]:
        """The services of the active profiles that an image built here runs."""
        spec = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
        return [name for name, s in spec.items() if name not in NOT_BUILT_HERE
                and (not s.get("profiles") or set(s["profiles"]) & set(self.profiles))]

    def container(self, service: str) -> str:
        """The service's one container (its id is kept: stop and start keep the container)."""
        if service not in self._containers:
            ids = self("ps", "-q", service).split()
            if len(ids) != 1:
                raise ComposeRunError(f"{service}: {len(ids)} containers")
            self._containers[service] = ids[0]
        return self._containers[service]

    def health(self, service: str) -> str:
        """The container's health ("healthy", "starting", "unhealthy"), or its state without a check."""
        fmt = "{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}"
        return subprocess.run(["docker", "inspect", "-f", fmt, self.container(service)], capture_output=True,
                              text=True, check=True).stdout.strip()

    def logs(self, *services: str, tail: int | None = None) -> str:
        args = ["logs", "--no-color"] + ([f"--tail={tail}"] if tail else [])
        return self(*args, *services, check=False)


def compose_env(kafka_port: int, redis_port: int, prometheus_port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED)}
    return {**env, "ROLLSTREAM_CONFIG": CONFIG, "PUBLISH_ADDRESS": "127.0.0.1", "KAFKA_EXTERNAL_HOST": "127.0.0.1",
            "KAFKA_EXTERNAL_PORT": str(kafka_port), "REDIS_PORT": str(redis_port),
            "PROMETHEUS_PORT": str(prometheus_port)}


async def wait_for(predicate: Callable[[], Any], timeout: float, what: str, compose: Compose,
                   poll: float = 2.0) -> float:
    """Seconds until ``await predicate()`` is true; ComposeRunError with the logs' ends on timeout."""
    began = time.monotonic()
    while not await predicate():
        if time.monotonic() - began > timeout:
            raise ComposeRunError(f"timed out after {timeout:.0f}s waiting for {what}\n{compose.logs(tail=15)}")
        await asyncio.sleep(poll)
    return time.monotonic() - began


@dataclass
class Run:
    args: argparse.Namespace
    compose: Compose
    config: RollstreamConfig
    report: Report
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def names(self) -> TopicNames:
        return TopicNames.of(self.config)

    async def version(self) -> int:
        client = connect(self.config.redis)
        try:
            return await VersionStore(client, RedisKeys(self.names.experiment, self.names.trial)).get_version()
        except (OSError, RedisError):  # not up yet
            return -1
        finally:
            await client.aclose()

    async def at_version(self, version: int) -> float:
        async def reached() -> bool:
            return await self.version() >= version
        return await wait_for(reached, self.args.timeout, f"trainer version {version}", self.compose)

    async def healthy(self, services: list[str], timeout: float) -> float:
        async def all_healthy() -> bool:
            states = {s: self.compose.health(s) for s in services}
            return all(state in ("healthy", "exited") for state in states.values())
        return await wait_for(all_healthy, timeout, f"{', '.join(services)} healthy", self.compose)

    async def restart(self, tier: str) -> dict[str, Any]:
        """``stop`` then ``start`` one tier; how long each took and what the trainer did meanwhile."""
        before = await self.version()
        began = time.monotonic()
        self.compose("stop", tier)
        stopped = time.monotonic() - began
        self.compose("start", tier)
        healthy = await self.healthy([tier], 300)
        progressed = await self.at_version(await self.version() + 1)
        return {"tier": tier, "stop s": round(stopped, 1), "start to healthy s": round(healthy, 1),
                "version before": before, "next version after s": round(progressed, 1)}

    def status(self) -> str:
        """``rollstream status`` in a container of the stack: every tier's group must show."""
        out = self.compose("run", "--rm", "--no-deps", "-T", "-e", "COLUMNS=200", "trainer", "rollstream", "status",
                           "--config", f"/etc/rollstream/{CONFIG}", "--once", timeout=180)
        missing = [tier for tier in STATUS_TIERS if not re.search(rf"^\W*{re.escape(tier)}\s", out, re.MULTILINE)]
        if missing:
            self.problems.append(f"rollstream status shows no row for {missing}")
        return out

    async def drain_and_account(self) -> dict[str, Any]:
        """Stop the producer, wait until every admitted prompt ended, check each ended once."""
        self.compose("stop", "producer")
        prompts = await read_topic(self.config.kafka, self.names.prompts, decode_prompt, settled=True)
        admitted = {p.task_id for p in prompts}
        async with BatchesWatcher(self.config.kafka, self.names.batches) as watcher:
            async def drained() -> bool:
                watcher.check_alive()
                return admitted <= watcher.ledger.accounted
            seconds = await wait_for(drained, self.args.timeout, f"all {len(admitted)} admitted prompts to end",
                                     self.compose, poll=1.0)
            await asyncio.sleep(3)  # anything that ends twice would show now
            ledger = watcher.ledger
        self.problems += ledger.check(admitted)
        if len(prompts) != len(admitted):
            self.problems.append(f"{len(prompts) - len(admitted)} prompts published twice")
        dead = await read_topic(self.config.kafka, self.names.dead_letter, decode_dead_letter, settled=True)
        client = connect(self.config.redis)
        try:
            usage = await StalenessBudget(client, RedisKeys(self.names.experiment, self.names.trial),
                                          self.config.staleness.max_head_offpolicyness,
                                          self.config.staleness.groups_per_step).usage()
        finally:
            await client.aclose()
        return {"admitted": len(admitted), "emitted groups": len(ledger.emitted),
                "dropped groups": dict(ledger.drop_reasons), "batch records": ledger.batches,
                "duplicate tasks": len(ledger.duplicate_tasks()), "duplicate rows": len(ledger.duplicate_rows()),
                "dead letters": len(dead), "redis admitted": usage.get("admitted"), "drain s": round(seconds, 1)}

    def prometheus_targets(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.compose.env['PROMETHEUS_PORT']}/api/v1/targets"
        with urllib.request.urlopen(url, timeout=10) as answer:
            targets = json.load(answer)["data"]["activeTargets"]
        up = sorted({t["labels"].get("service", "?") for t in targets if t["health"] == "up"})
        missing = [tier for tier in TIERS if tier not in up]
        if missing:
            self.problems.append(f"Prometheus does not scrape {missing} (up: {up})")
        return {"targets": len(targets), "up": up}

    def memory(self) -> list[dict[str, Any]]:
        rows = []
        ids = {self.compose.container(s): s for s in self.compose.services() if s not in ("topics", "demo-assets")}
        out = subprocess.run(["docker", "stats", "--no-stream", "--format", "{{.ID}} {{.MemUsage}} {{.CPUPerc}}",
                              *ids], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            cid, usage, *_, cpu = line.split()
            service = next(s for i, s in ids.items() if i.startswith(cid))
            rows.append({"service": service, "memory": usage, "cpu": cpu})
        return sorted(rows, key=lambda r: r["service"])

    def started(self, since: float) -> list[dict[str, Any]]:
        """When each container started, in seconds after ``since`` (a wall-clock time): compose
        starts a service once what it depends on is healthy or done, so the gaps show who waited
        for whom (the rollout worker for vLLM, every tier for demo-assets)."""
        ids = {self.compose.container(s): s for s in self.compose.services()}
        out = subprocess.run(["docker", "inspect", "-f", "{{.Id}} {{.State.StartedAt}} {{.State.FinishedAt}}", *ids],
                             capture_output=True, text=True, check=True).stdout
        rows = []
        for line in out.splitlines():
            cid, started, finished = line.split()
            row = {"service": ids[cid] if cid in ids else next(s for i, s in ids.items() if cid.startswith(i)),
                   "started s": round(_epoch(started) - since, 1)}
            if not finished.startswith("0001"):
                row["exited s"] = round(_epoch(finished) - since, 1)
            rows.append(row)
        return sorted(rows, key=lambda r: r["started s"])

    def steps(self) -> list[tuple[int, int, float]]:
        return [(int(m[1]), int(m[2]), float(m[3])) for m in STEP_LINE.finditer(self.compose.logs("trainer"))]


def _epoch(docker_time: str) -> float:
    """Seconds since the epoch of a Docker timestamp (RFC 3339 with nanoseconds, UTC)."""
    whole, _, fraction = docker_time.rstrip("Z").partition(".")
    return datetime.fromisoformat(whole).replace(tzinfo=timezone.utc).timestamp() + float(f"0.{fraction or 0}")


async def measure(args: argparse.Namespace, report: Report) -> None:
    kafka_port, redis_port, prometheus_port = free_port(), free_port(), free_port()
    profiles = ["cpu"] + (["monitoring"] if args.monitoring else [])
    compose = Compose(args.project, profiles, compose_env(kafka_port, redis_port, prometheus_port))
    environ = {"KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{kafka_port}", "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"}
    run = Run(args, compose, load_config(ROOT / "deploy" / CONFIG, environ=environ), report)
    timeline: dict[str, float] = {}
    compose("down", "-v", "--remove-orphans", timeout=300)  # what an earlier run may have left
    began, began_wall = time.monotonic(), time.time()
    try:
        compose("up", "-d", *compose.services(), timeout=900)
        timeline["up -d returned"] = time.monotonic() - began
        started = run.started(began_wall)
        await run.at_version(1)
        timeline["first trainer step"] = time.monotonic() - began
        await run.healthy([t for t in TIERS], 400)
        timeline["every tier healthy"] = time.monotonic() - began
        restarts = [await run.restart(tier) for tier in args.restart]
        await run.at_version(args.steps)
        timeline[f"trainer step {args.steps}"] = time.monotonic() - began
        status = run.status()
        print(status)
        memory = run.memory()
        targets = run.prometheus_targets() if args.monitoring else None
        accounting = await run.drain_and_account()
        timeline["drained and checked"] = time.monotonic() - began
        steps = run.steps()
    except BaseException:
        print(compose.logs(tail=40), file=sys.stderr)
        raise
    finally:
        if not args.keep:
            down = time.monotonic()
            compose("down", "-v", "--remove-orphans", timeout=600, check=False)
            timeline["down -v"] = time.monotonic() - down
            left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={args.project}"],
                                  capture_output=True, text=True).stdout.split()
            if left:
                run.problems.append(f"{len(left)} containers left after down")
    report.table("timeline (seconds from `up -d`; down: its own time)",
                 [{"event": k, "seconds": round(v, 1)} for k, v in timeline.items()])
    report.table("containers started (seconds from `up -d`)", started)
    if restarts:
        report.table("stop / start of a tier", restarts)
    report.table("memory and CPU per service (docker stats, at the last step)", memory)
    report.table("accounting (from the topics, after the producer stopped)", [accounting])
    head, tail = steps[:3], steps[-3:]
    report.table("trainer steps (its log)", [{"step": s, "version": v, "reward": r} for s, v, r in head + tail])
    if targets is not None:
        report.table("prometheus", [targets])
    report.extra.update(steps=len(steps), accounting=accounting, problems=run.problems)
    report.target("problems", len(run.problems), 0, higher_is_better=False)
    report.target("trainer steps", max((s for s, _, _ in steps), default=0), args.steps)
    for problem in run.problems:
        print(f"PROBLEM: {problem}")


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("compose_run", __doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="trainer steps (weight versions) to wait for")
    parser.add_argument("--restart", action="append", default=None, choices=(*TIERS, "vllm"),
                        help="a tier to stop and start while it runs (repeatable; default rollout-worker-cpu, grouping)")
    parser.add_argument("--monitoring", action="store_true", help="also Prometheus; check it scrapes every tier")
    parser.add_argument("--project", default="rollstream-check", help="compose project name")
    parser.add_argument("--timeout", type=float, default=600, help="seconds any one wait may take")
    parser.add_argument("--keep", action="store_true", help="leave the stack up at the end")
    args = parser.parse_args(argv)
    if args.restart is None:
        args.restart = ["rollout-worker-cpu", "grouping"]
    report = Report("compose_run", args.quick)
    asyncio.run(measure(args, report))
    return report.finish(args.out)


if __name__ == "__main__":
    sys.exit(main())

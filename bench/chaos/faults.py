"""Carrying out one fault of the schedule on the running stage, and putting things back.

Every fault restores what it broke before it returns (a killed instance or node is started
again, a paused one continued, Redis started), except a rollout worker that leaves, which
stays away until a join. While a fault lasts, the pipeline is supervised (a tier that exits
unasked is restarted and counted). After a node fault the next one waits until every partition
is fully replicated again, so no two nodes are ever out at once.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import json

import redis.asyncio as aioredis

from bench.chaos import schedule as kinds
from bench.chaos.observe import Observer
from bench.chaos.schedule import Fault
from harness.cluster import ClusterProbe
from harness.pipeline import Pipeline
from harness.tiers import TierProcess
from rollstream.dev.cluster import LocalKafkaCluster
from rollstream.dev.redis_server import LocalRedisServer
from rollstream.dev.vllm_server import LocalVLLMServer
from rollstream.state.server_lease import ServerLeases


NODE_START_TIMEOUT = 240.0
REPLICATION_TIMEOUT = 180.0
STOP_TIMEOUT = 120.0  # a rollout worker that leaves: its grace period and some
SERVER_START_TIMEOUT = 400.0  # a vLLM server on 2 busy cores
LOAD_WAIT = 90.0  # the owner faults wait this long for the next weight load


@dataclass
class Stage:
    """What the faults act on."""

    pipeline: Pipeline
    cluster: LocalKafkaCluster
    probe: ClusterProbe
    redis: LocalRedisServer
    observer: Observer
    vllm: LocalVLLMServer | None = None  # a run on a vLLM server: its one server
    leases: ServerLeases | None = None  # that server's weight-sync lease (to find its owner)


@dataclass
class Done:
    """One fault as it happened: when it began (seconds after the faults began), how long it
    took with its recovery, and anything worth saying (a graceful stop that was not)."""

    fault: Fault
    began: float
    took: float
    note: str = ""

    def line(self) -> str:
        note = f" ({self.note})" if self.note else ""
        return f"{self.fault.line()}: began t+{self.began:.1f}s, took {self.took:.1f}s{note}"


async def execute(stage: Stage, fault: Fault, began: float) -> Done:
    """Carry ``fault`` out (``began``: its start, seconds after the faults began). A fault that
    cannot be carried out (a node that does not start again) says so in its note."""
    started = time.monotonic()
    try:
        note = await _ACTIONS[fault.kind](stage, fault)
    except Exception as exc:  # noqa: BLE001 - a fault that could not be carried out is reported, the run goes on
        note = f"FAILED to carry out: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return Done(fault, began, time.monotonic() - started, note or "")


def _node(fault: Fault) -> int:
    return int(fault.target.removeprefix("node-"))


async def _replicated(stage: Stage) -> str:
    try:
        waited = await stage.probe.wait_fully_replicated(REPLICATION_TIMEOUT)
    except AssertionError as exc:
        return f"not fully replicated after {REPLICATION_TIMEOUT:.0f}s: {exc}"
    return f"full ISR {waited:.0f}s after"


async def _kill(stage: Stage, fault: Fault) -> str:
    process = stage.pipeline.tiers[fault.target]
    note = "" if process.running() else "was not running"
    process.kill()
    await stage.pipeline.sleep(fault.seconds)
    process.start()
    return note


async def _pause(stage: Stage, fault: Fault) -> str:
    process = stage.pipeline.tiers[fault.target]
    if not process.running():
        return "was not running: nothing paused"
    process.pause()
    try:
        await stage.pipeline.sleep(fault.seconds)
    finally:
        process.resume()
    return ""


async def _node_kill(stage: Stage, fault: Fault) -> str:
    node = _node(fault)
    stage.cluster.kill_node(node)
    await stage.pipeline.sleep(fault.seconds)
    await stage.pipeline.in_thread(lambda: stage.cluster.start_node(node), NODE_START_TIMEOUT, f"node {node} to start")
    return await _replicated(stage)


async def _node_restart(stage: Stage, fault: Fault) -> str:
    node = _node(fault)
    await stage.pipeline.in_thread(lambda: stage.cluster.restart_node(node), NODE_START_TIMEOUT,
                                   f"node {node} to restart")
    return await _replicated(stage)


async def _node_pause(stage: Stage, fault: Fault) -> str:
    node = _node(fault)
    stage.cluster.pause_node(node)
    try:
        await stage.pipeline.sleep(fault.seconds)
    finally:
        stage.cluster.resume_node(node)
    return await _replicated(stage)


async def _redis_restart(stage: Stage, fault: Fault, wipe: bool = False) -> str:
    """With its data: a crash (SIGKILL) and a start from the append-only file, fsynced every
    second as deployed, so the last second of writes may be gone. Without: a clean stop and a
    start with nothing, what a Redis without persistence keeps."""
    redis = stage.redis
    stage.observer.redis_forgets()
    if wipe:
        await stage.pipeline.in_thread(redis.stop, 60, "redis to stop")
        _forget(redis.workdir)
    else:
        redis.kill()
    await stage.pipeline.sleep(fault.seconds)
    await stage.pipeline.in_thread(redis.start, 60, "redis to start")
    stage.observer.redis_back()
    return ""


async def _redis_restore(stage: Stage, fault: Fault) -> str:
    """A snapshot of this moment, ``seconds`` of work, then a crash and a start from the
    snapshot: a new redis-server process with every key as it was (a restart from the last RDB
    snapshot, a failover to a replica that lagged)."""
    redis = stage.redis
    snapshot: list[Path] = []
    await stage.pipeline.in_thread(lambda: snapshot.append(redis.snapshot()), 60, "the redis snapshot")
    await stage.pipeline.sleep(fault.seconds)
    stage.observer.redis_forgets()
    await stage.pipeline.in_thread(lambda: redis.restore(snapshot[0]), 60, "redis to start from the snapshot")
    stage.observer.redis_back()
    return f"snapshot {fault.seconds:.1f}s old"


def _forget(workdir: Path) -> None:
    shutil.rmtree(workdir / "appendonlydir", ignore_errors=True)
    for name in ("appendonly.aof", "dump.rdb"):
        (workdir / name).unlink(missing_ok=True)


async def _redis_wipe(stage: Stage, fault: Fault) -> str:
    return await _redis_restart(stage, fault, wipe=True)


def rollout_worker(pipeline: Pipeline, worker_id: str) -> TierProcess:
    """The rollout worker ``worker_id`` (``rollout.worker_id``), created on its first use."""
    if worker_id not in pipeline.tiers:
        pipeline.add(worker_id, "rollout-worker", f"rollout.worker_id={worker_id}")
    return pipeline.tiers[worker_id]


async def _stop(stage: Stage, process: TierProcess) -> str:
    job = asyncio.ensure_future(asyncio.to_thread(process.stop, STOP_TIMEOUT))
    await stage.pipeline.wait_for(job.done, STOP_TIMEOUT + 60, f"{process.name} to stop")
    code = job.result()
    return "" if code == 0 else f"exited with {code} on SIGTERM"


async def _join(stage: Stage, fault: Fault) -> str:
    process = rollout_worker(stage.pipeline, fault.target)
    if process.running():
        return "was running already"
    process.start()
    return ""


async def _leave(stage: Stage, fault: Fault) -> str:
    return await _stop(stage, stage.pipeline.tiers[fault.target])


async def _restart(stage: Stage, fault: Fault) -> str:
    process = stage.pipeline.tiers[fault.target]
    note = await _stop(stage, process)
    process.start()
    return note


async def _next_load(stage: Stage) -> str | None:
    """The worker id of the owner of the server as it starts its next load (its "loading"
    record in Redis), or None when no load began within ``LOAD_WAIT`` seconds."""
    assert stage.leases is not None
    client = aioredis.from_url(stage.redis.url)
    pubsub = client.pubsub()
    try:
        await pubsub.subscribe(stage.leases.channel)
        deadline = time.monotonic() + LOAD_WAIT
        while time.monotonic() < deadline:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message and json.loads(message["data"]).get("phase") == "loading":
                return str(json.loads(message["data"])["owner"]).rsplit(":", 1)[0]
        return None
    finally:
        await pubsub.aclose()
        await client.aclose()


async def _owner_now(stage: Stage) -> str | None:
    assert stage.leases is not None and stage.vllm is not None
    holder = await stage.leases.holder(stage.vllm.url)
    return holder[0].rsplit(":", 1)[0] if holder else None


async def _owner_pause(stage: Stage, fault: Fault) -> str:
    """SIGSTOP the sync owner as it starts a load, for longer than its lease: a successor
    takes the server over; the owner's calls that follow must change nothing (the fence)."""
    owner = await _next_load(stage)
    note = ""
    if owner is None:
        owner, note = await _owner_now(stage), f"no load began in {LOAD_WAIT:.0f}s: paused the owner idle"
    if owner is None or owner not in stage.pipeline.tiers:
        return f"no owner to pause ({owner})"
    process = stage.pipeline.tiers[owner]
    process.pause()
    try:
        await stage.pipeline.sleep(fault.seconds)
    finally:
        process.resume()
    return note or f"{owner} paused in its load"


async def _owner_kill(stage: Stage, fault: Fault) -> str:
    owner = await _owner_now(stage)
    if owner is None or owner not in stage.pipeline.tiers:
        return f"no owner to kill ({owner})"
    process = stage.pipeline.tiers[owner]
    process.kill()
    await stage.pipeline.sleep(fault.seconds)
    process.start()
    return f"{owner} killed"


async def _server_kill(stage: Stage, fault: Fault) -> str:
    """SIGKILL the vLLM server as its owner starts a load (mid-transfer), start it again: it
    comes back on its launch weights, and its owner must bring it up to date before use."""
    assert stage.vllm is not None
    note = "" if await _next_load(stage) else f"no load began in {LOAD_WAIT:.0f}s: killed the server idle"
    stage.vllm.kill()
    await stage.pipeline.sleep(fault.seconds)
    await stage.pipeline.in_thread(stage.vllm.start, SERVER_START_TIMEOUT, "the vLLM server to start")
    return note or f"killed in a load; back in {stage.vllm.startup_seconds:.0f}s"


_ACTIONS = {
    kinds.KILL: _kill, kinds.PAUSE: _pause, kinds.NODE_KILL: _node_kill, kinds.NODE_RESTART: _node_restart,
    kinds.NODE_PAUSE: _node_pause, kinds.REDIS_RESTART: _redis_restart, kinds.REDIS_WIPE: _redis_wipe,
    kinds.REDIS_RESTORE: _redis_restore,
    kinds.JOIN: _join, kinds.LEAVE: _leave, kinds.RESTART: _restart,
    kinds.OWNER_PAUSE: _owner_pause, kinds.SERVER_KILL: _server_kill, kinds.OWNER_KILL: _owner_kill,
}

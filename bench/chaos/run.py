"""The chaos run: the stage, the schedule carried out on it, the drain, the verdict.

Phases: (1) a 3-node cluster, a Redis with an append-only file, the tiers and the trainer as
processes; the faults wait for the trainer's first step. (2) the schedule, fault after fault,
for ``minutes`` (a fault due after the end is left out). (3) the drain: the producers get
SIGTERM; every admitted prompt must end, the trainer must train every whole step, the tiers'
consumer groups must have nothing left. (4) the final checks, then everything stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator
from typing import Any

from bench.chaos import invariants as inv
from bench.chaos.audit import audit_groups
from bench.chaos.faults import Done, Stage, execute, rollout_worker
from bench.chaos.observe import Observer
from bench.chaos.schedule import TRAINER, Fault, Fleet, draw_schedule
from harness.cluster import ClusterProbe
from harness.configs import pipeline_config
from harness.ledger import TopicFollower, read_records, unconsumed
from harness.pipeline import Pipeline, write_dataset
from harness.waits import stop_task
from rollstream.config import ServerLaunchConfig, config_from_dict
from rollstream.dev.cluster import LocalKafkaCluster
from rollstream.dev.redis_server import LocalRedisServer
from rollstream.dev.vllm_server import LocalVLLMServer
from rollstream.state.client import RedisKeys, connect
from rollstream.state.server_lease import ServerLeases
from rollstream.wire import EmittedGroup, decode_group, decode_prompt


log = logging.getLogger(__name__)

DATASET_LINES = 1000  # read again each epoch: the producers never run out
LAG_TIMEOUT = 120.0
TIER_GROUPS = {"rollout-worker": "prompts", "reward-worker": "episodes", "grouping": "scored"}


@dataclass(frozen=True)
class Settings:
    minutes: float
    seed: int
    mean_gap: float = 22.0  # seconds between faults, on average
    fleet: Fleet = Fleet()
    group_size: int = 4
    groups_per_step: int = 4  # B: groups per trainer step, the staleness budget's unit
    eta: int = 1  # staleness.max_head_offpolicyness
    max_new_tokens: int = 8
    startup_timeout: float = 480.0
    drain_timeout: float = 600.0
    # "vllm": the rollout workers generate on one real vLLM server, versions reach it over the
    # wire (a checkpoint each, kept for the audit), and the weight path's faults are drawn
    engine: str = "hf"


@dataclass
class Result:
    settings: Settings
    planned: list[Fault]
    done: list[Done]
    violations: list[inv.Violation]
    figures: dict[str, Any] = field(default_factory=dict)
    exits: dict[str, list[str]] = field(default_factory=dict)  # instance -> its unasked exits

    def by_kind(self) -> Counter[str]:
        return Counter(d.fault.kind for d in self.done)


def chaos_config(bootstrap: str, redis_url: str, name: str, model: Path, dataset: Path, workdir: Path,
                 s: Settings, server_url: str = "") -> dict[str, Any]:
    """The fault tests' pipeline config, replicated, with a real trainer and the run's sizes;
    with ``server_url``, the rollout workers on that vLLM server, versions over the wire."""
    tree = pipeline_config(bootstrap, redis_url, name, model, dataset, None)
    tree["kafka"].update({"replication_factor": 3, "prompt_partitions": s.fleet.rollout_max})
    tree["staleness"] = {"groups_per_step": s.groups_per_step, "max_head_offpolicyness": s.eta}
    tree["producer"].update({"group_size": s.group_size, "epochs": 1000, "max_batch_prompts": s.groups_per_step})
    tree["rollout"].update({"gconfig": {"max_new_tokens": s.max_new_tokens}, "max_concurrent_rollouts": 8,
                            "failure_detection_seconds": 6, "shutdown_grace_seconds": 30})
    tree["reward"]["reward_fn"] = "bench.chaos.rewards:exact_match_or_fail"  # one group in ~10 dropped
    tree["grouping"]["drop_stale"] = True
    tree["trainer"] = {"group_id": f"{name}-trainer", "model_path": str(model),
                       "checkpoint_dir": str(workdir / "checkpoints"), "session_timeout_ms": 6000,
                       "learning_rate": 1e-5, "keep_checkpoints": 4}
    if server_url:
        tree["rollout"].update({
            "engine": "vllm", "server_urls": [server_url], "tokenizer_path": str(model),
            "weight_transfer": "distributed",
            "server": {"lease_ttl_seconds": 5.0, "reconcile_seconds": 1.0, "version_poll_seconds": 0.2,
                       "health_timeout_seconds": 300, "backoff_max_seconds": 2.0}})
        # every version's weights stay on disk: the audit recomputes each token's logprob with them
        tree["trainer"].update({"keep_checkpoints": 100_000, "checkpoint_every": 1,
                                "weight_sender": {"timeout_seconds": 30}})
    return tree


def add_tiers(pipeline: Pipeline, fleet: Fleet, steps_file: Path) -> None:
    for i in range(fleet.producers):
        pipeline.add(f"producer-{i}", "producer", f"producer.producer_id=producer-{i}")
    for i in range(fleet.rollout):
        rollout_worker(pipeline, f"rollout-{i}")
    for i in range(fleet.reward):
        pipeline.add(f"reward-{i}", "reward-worker", f"reward.worker_id=reward-{i}")
    for i in range(fleet.grouping):
        pipeline.add(f"grouping-{i}", "grouping", f"grouping.instance_id=grouping-{i}")
    pipeline.add(TRAINER, "train", args=["--steps-file", str(steps_file)])


async def run_chaos(s: Settings, workdir: Path, model: Path, cluster: LocalKafkaCluster | None = None) -> Result:
    """The whole run in ``workdir`` (Redis, logs, checkpoints) on the tiny ``model``, on
    ``cluster`` (its nodes all running; default: a cluster of its own in ``workdir``)."""
    planned = draw_schedule(s.seed, s.minutes * 60, s.fleet, s.mean_gap, weight_path=s.engine == "vllm")
    print(f"{len(planned)} faults planned by seed {s.seed} over {s.minutes:g} minutes:", flush=True)
    for fault in planned:
        print("  " + fault.line())
    own = cluster is None
    if cluster is None:
        cluster = LocalKafkaCluster(workdir / "cluster", brokers=s.fleet.nodes, heap="384m")
        await asyncio.to_thread(cluster.start)
        print(f"cluster of {s.fleet.nodes} nodes up in {cluster.startup_seconds:.0f}s", flush=True)
    elif len(cluster.running_nodes()) != s.fleet.nodes:
        raise ValueError(f"the schedule needs {s.fleet.nodes} running nodes, the cluster has {cluster.running_nodes()}")
    try:
        with LocalRedisServer(workdir / "redis", appendonly=True) as redis, _server(s, workdir, model) as vllm:
            return await _on_stage(s, planned, workdir, model, cluster, redis, vllm)
    finally:
        if own:
            await asyncio.to_thread(cluster.stop)


@contextlib.contextmanager
def _server(s: Settings, workdir: Path, model: Path) -> Iterator[LocalVLLMServer | None]:
    """A run on a vLLM server: the server (the tiny model), up before the tiers."""
    if s.engine != "vllm":
        yield None
        return
    server = LocalVLLMServer(workdir / "vllm", model, ServerLaunchConfig(max_model_len=256, cuda_graphs=False))
    server.start()
    print(f"vLLM server up in {server.startup_seconds:.0f}s at {server.url}", flush=True)
    try:
        yield server
    finally:
        server.stop()


async def _on_stage(s: Settings, planned: list[Fault], workdir: Path, model: Path, cluster: LocalKafkaCluster,
                    redis: LocalRedisServer, vllm: LocalVLLMServer | None) -> Result:
    name = f"chaos{s.seed}"
    dataset = write_dataset(workdir / "prompts.jsonl", DATASET_LINES)
    tree = chaos_config(cluster.bootstrap, redis.url, name, model, dataset, workdir, s, vllm.url if vllm else "")
    config = config_from_dict(tree)
    observer = Observer(config, Path(tree["trainer"]["checkpoint_dir"]) / "ledger.jsonl")
    pipeline = Pipeline(tree, workdir, model, stand_in_trainer=False, on_batch=observer.on_batch)
    observer.follow(pipeline.ledger)
    leases = None
    if vllm is not None:
        keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
        leases = ServerLeases(connect(config.redis), keys, "chaos-observer", config.rollout.server.lease_ttl_seconds)
    stage = Stage(pipeline, cluster, ClusterProbe(cluster, pipeline.config.kafka), redis, observer, vllm, leases)
    began = time.monotonic()
    async with pipeline, TopicFollower(pipeline.config.kafka, pipeline.names.prompts, observer.on_prompt) as prompts:
        watching = asyncio.create_task(observer.watch(), name="observer")
        try:
            add_tiers(pipeline, s.fleet, workdir / "steps.jsonl")
            for process in pipeline.tiers.values():
                process.start()
            await pipeline.wait_for(lambda: observer.timeline.latest >= 1, s.startup_timeout,
                                    "the trainer's first step")
            startup = time.monotonic() - began
            print(f"{time.strftime('%H:%M:%S')} pipeline up in {startup:.0f}s: faults begin", flush=True)
            done = await _faults(stage, planned, s.minutes * 60)
            drain = await _drain(stage, s, prompts)
            result = Result(s, planned, done, [], exits=_exits(pipeline))
            result.figures = {"startup seconds": round(startup), **drain, **_figures(stage)}
            if vllm is not None:
                result.figures |= await _audit(stage, model, Path(tree["trainer"]["checkpoint_dir"]))
            if watching.done():  # the live checks stopped: the run proves nothing
                watching.result()
                raise RuntimeError("the observer stopped watching before the end")
        finally:
            await stop_task(watching, "the observer of the run")
    result.violations = observer.violations
    result.figures["wall seconds"] = round(time.monotonic() - began)
    return result


async def _faults(stage: Stage, planned: list[Fault], seconds: float) -> list[Done]:
    start = time.monotonic()
    done: list[Done] = []
    for fault in planned:
        await stage.pipeline.sleep(max(0.0, start + fault.at - time.monotonic()))
        began = time.monotonic() - start
        if began >= seconds:
            break
        print(f"{time.strftime('%H:%M:%S')} t+{began:.0f}s {fault.kind} {fault.target}"
              + (f" for {fault.seconds:.1f}s" if fault.seconds else ""), flush=True)
        done.append(await execute(stage, fault, began))
        if done[-1].note:
            print(f"    {done[-1].note}", flush=True)
    return done


async def _drain(stage: Stage, s: Settings, prompts: TopicFollower) -> dict[str, Any]:
    """Stop the producers; wait until everything admitted ended and every tier consumed it all;
    check the end. Returns the drain's figures."""
    pipeline, observer = stage.pipeline, stage.observer
    began = time.monotonic()
    for name, process in pipeline.tiers.items():
        if process.tier == "producer":
            process.signal_stop()  # all at once; each commits what it admitted
    for name, process in pipeline.tiers.items():
        if process.tier == "producer":
            await pipeline.in_thread(lambda p=process: p.stop(120.0), 180, f"{name} to stop")
    records = await read_records(pipeline.config.kafka, pipeline.names.prompts)
    tasks = [decode_prompt(r.value) for r in records]
    admitted = {t.task_id for t in tasks if not t.is_eval}
    await pipeline.wait_for(lambda: observer.prompt_records >= len(records), 120, "the prompts follower")
    prompts.check_alive()
    ledger = pipeline.ledger
    ended = await _until(pipeline, lambda: admitted <= ledger.accounted, s.drain_timeout)
    trained = await _until(pipeline, lambda: _waiting(observer, ledger) < s.groups_per_step, 300)
    lags = await _lags(stage)
    entries = observer.read_ledger()
    trainer_left = await unconsumed(pipeline.config.kafka, pipeline.names.batches, pipeline.config.trainer.group_id)
    waiting = sum(isinstance(decode_group(r.value), EmittedGroup) for r in trainer_left)
    emitted = set(ledger.emitted)
    observer.report(inv.accounting(admitted, len(records), ledger))
    observer.report(inv.trained_twice(entries))
    observer.report(inv.trained_unknown(entries, emitted))
    observer.report(inv.step_sequence(entries))
    observer.report(inv.admission_excess(list(observer.prompts.values()), observer.drop_times + observer.stale_times,
                                         observer.timeline, s.eta, s.groups_per_step))
    observer.report(inv.left_in_flight(admitted, ledger, lags, waiting, s.groups_per_step))
    return {"drain seconds": round(time.monotonic() - began), "every prompt ended in the drain": ended,
            "trainer caught up in the drain": trained, "admitted": len(admitted), "prompt records": len(records),
            "trainer groups waiting at the end": waiting, "lags at the end": lags}


async def _audit(stage: Stage, model: Path, checkpoints: Path) -> dict[str, Any]:
    """Every generated token on ``batches``, its logprob recomputed with the weights of the
    version it is tagged with (each version's checkpoint): a violation for each that disagrees."""
    records = await read_records(stage.pipeline.config.kafka, stage.pipeline.names.batches)
    groups = [m for m in (decode_group(r.value) for r in records) if isinstance(m, EmittedGroup)]
    result = await asyncio.to_thread(audit_groups, groups, model, checkpoints)
    stage.observer.report(inv.logprob_tags(result))
    return {"tokens audited by their logprob": result.tokens, "mis-tagged tokens": result.mistagged,
            "versions audited": len(result.versions), "rows spanning several versions": result.rows_with_several_versions}


async def _until(pipeline: Pipeline, predicate: Any, timeout: float) -> bool:
    try:
        await pipeline.wait_for(predicate, timeout, "the drain")
    except AssertionError as exc:
        print(f"drain: {str(exc).splitlines()[0]}", flush=True)
        return False
    return True


def _waiting(observer: Observer, ledger: Any) -> int:
    """Groups on ``batches`` the trainer has not taken (trained or dropped as stale, as far as
    its ledger says)."""
    taken = sum(len(e.task_ids) + len(e.stale) for e in observer.entries)
    return len(ledger.emitted) - taken


async def _lags(stage: Stage) -> dict[str, int]:
    """Records each tier's consumer group has not consumed; waited for until all are 0 (a tier
    commits on an interval) or ``LAG_TIMEOUT`` passes."""
    pipeline = stage.pipeline
    deadline = time.monotonic() + LAG_TIMEOUT
    while True:
        lags = {}
        for tier, role in TIER_GROUPS.items():
            topic = getattr(pipeline.names, role)
            lags[tier] = len(await unconsumed(pipeline.config.kafka, topic, pipeline.names.group_id(tier)))
        if not any(lags.values()) or time.monotonic() > deadline:
            return lags
        await pipeline.sleep(2.0)


def _exits(pipeline: Pipeline) -> dict[str, list[str]]:
    """Each unasked exit with the last line of the instance's log that looks like its cause."""
    found = {}
    for name, process in pipeline.tiers.items():
        if process.unexpected_exits:
            errors = [line for line in process.grep("Error") if "WARNING" not in line][-3:]
            found[name] = [f"exit codes {process.unexpected_exits}", *errors]
    return found


def _behind(observer: Observer) -> dict[int, int]:
    """How many versions behind the version its step trained each trained group was."""
    counts: Counter[int] = Counter()
    for entry in observer.entries:
        for task in entry.task_ids:
            if observer.heads.get(task, -1) >= 0:
                counts[entry.step - 1 - observer.heads[task]] += 1
    return dict(sorted(counts.items()))


def _figures(stage: Stage) -> dict[str, Any]:
    pipeline, observer = stage.pipeline, stage.observer
    ledger = pipeline.ledger
    rebuilds = sum(len(p.grep("staleness budget rebuilt")) for p in pipeline.tiers.values() if p.tier == "producer")
    return {
        "emitted groups": len(ledger.emitted), "dropped groups": dict(ledger.drop_reasons),
        "trainer steps": len(observer.entries), "trained groups": sum(len(e.task_ids) for e in observer.entries),
        "groups the trainer dropped as stale": sum(len(e.stale) for e in observer.entries),
        "trained groups by versions behind": _behind(observer),
        "trainer steps redone after a crash": observer.steps_redone,
        "highest version in redis": observer.highest_version,
        "batches checked": observer.batches_checked, "tokens checked": observer.tokens_checked,
        "redis samples": observer.redis_samples, "redis unreadable": observer.redis_unreadable,
        "worst admitted - dropped - capacity in redis": (
            f"{observer.worst_budget[0]} ({observer.worst_budget[1]})" if observer.worst_budget else "no sample"),
        "budget rebuilds (producers' logs)": rebuilds,
        "kills": {n: p.kills for n, p in pipeline.tiers.items() if p.kills},
        "pauses": {n: p.pauses for n, p in pipeline.tiers.items() if p.pauses},
        "starts": {n: p.starts for n, p in pipeline.tiers.items()},
    }

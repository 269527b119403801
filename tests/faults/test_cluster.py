"""Exactly-once accounting on a replicated 3-node cluster while its nodes are killed, restarted
one by one and cut off, and while tiers are killed.

The cluster (the ``kafka_cluster`` fixture of ``tests/faults/conftest.py``, probed with
``harness/cluster.py``): three local KRaft nodes, each a broker and a controller voter;
the trial's topics and the internal ones (consumer offsets, transaction state) at replication 3 with ``min.insync.replicas`` 2; the tiers produce with ``acks=all`` and
idempotence. The pipeline is the one of ``test_exactly_once.py`` (the tiers as separate
processes, the tiny HF model, a stand-in trainer pacing the producer), with
``grouping.drop_stale`` on so that the staleness bound is enforced at emission too.

While it runs, in order, each at a point of progress (the node found at that moment, killed,
left down for a few seconds, started again, and the next fault only once every partition has
its full ISR again; the stand-in trainer publishes no version while a fault lasts, so that a slow
recovery on a busy machine cannot let the run end before its last fault):

1. SIGKILL of the leader of ``prompts`` partition 0 (its leadership must move);
2. SIGKILL of the reward worker;
3. SIGKILL of the leader of ``scored`` partition 1;
4. SIGKILL of the transaction coordinator of the grouping tier's transactional id for
   ``scored`` partition 0 (``<group id>.p0``, found with FindCoordinator);
5. SIGKILL of the active controller (the quorum leader; another node must take over);
6. SIGKILL of the grouping instance;
7. a rolling restart: each node in turn stopped cleanly and started, waiting for full ISR;
8. a network partition of the node leading ``scored`` partition 0: SIGSTOP for 8 s (longer
   than the 4 s broker session, so the controller fences it and moves its leaderships), then
   SIGCONT.

The test prints each step with its time (shown when it fails, a timeout included), and the
schedule has one deadline whose error names the step in progress.

Then it checks: admitted = emitted + counted drops, no task or row twice, none lost; the
staleness bound ``admitted - dropped <= (eta + version + 1) * groups_per_step`` held at every sample
of the Redis counters; no emitted batch staler than ``max_head_offpolicyness``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from harness.budget_watch import BudgetWatch
from harness.cluster import ClusterProbe, FaultRecord
from harness.configs import pipeline_config
from harness.ledger import read_topic
from harness.pipeline import Outcome, Pipeline, write_dataset
from harness.reports import ShowReport
from harness.timeline import Timeline
from rollstream.config import KafkaConfig
from rollstream.dev.cluster import LocalKafkaCluster
from rollstream.dev.redis_server import LocalRedisServer
from rollstream.kafka.admin import describe_topics, ensure_topics
from rollstream.kafka.clients import make_admin
from rollstream.kafka.topics import TopicNames
from rollstream.wire import EmittedGroup, decode_group


pytestmark = [pytest.mark.broker, pytest.mark.slow]

PROMPTS = int(os.environ.get("ROLLSTREAM_CLUSTER_PROMPTS", "120"))
# the stand-in trainer's pace (seconds per version): slower while faults remain, so that every
# fault strikes a running pipeline, then quick to the end
FAULT_STEP_SECONDS = 4.0
FINAL_STEP_SECONDS = 1.0
SCHEDULE_SECONDS = 390.0  # the whole fault schedule (about 100 s on a quiet machine)
FINISH_SECONDS = 120.0  # from the last fault to every group ended
DOWN_SECONDS = 2.0  # how long a killed node stays down
PARTITION_SECONDS = 8.0  # how long the paused node is cut off
TIERS = {"producer": "producer", "rollout": "rollout-worker", "reward": "reward-worker", "grouping-0": "grouping"}

Fault = Callable[[Pipeline, ClusterProbe], Awaitable[FaultRecord]]


async def _down_and_up(pipeline: Pipeline, probe: ClusterProbe, kind: str, node: int, detail: str,
                       moved: Callable[[], Awaitable[int]] | None) -> FaultRecord:
    """SIGKILL ``node``; check that ``moved()`` (the role's new holder) is another node; start
    it again; wait until every partition is fully replicated."""
    record = FaultRecord(kind, node, pipeline.progress(), detail=detail)
    began = time.monotonic()
    probe.cluster.kill_node(node)
    probe.say(f"{kind}: node {node} killed")
    if moved is not None:
        taker = await moved()
        assert taker != node, f"{kind}: node {node} was killed but still holds the role"
        record.detail = "; ".join(filter(None, [detail, f"taken over by node {taker}"]))
        probe.say(f"{kind}: taken over by node {taker}")
    await pipeline.sleep(DOWN_SECONDS)
    await pipeline.in_thread(lambda: probe.cluster.start_node(node), 180, f"node {node} to start")
    probe.say(f"{kind}: node {node} started; waiting for full ISR")
    await probe.wait_fully_replicated()
    record.seconds = time.monotonic() - began
    return record


async def _until_other(probe: ClusterProbe, ask: Callable[[], Awaitable[int]], old: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while (holder := await ask()) == old and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    return holder


def kill_leader(role: str, partition: int) -> Fault:
    async def fault(pipeline: Pipeline, probe: ClusterProbe) -> FaultRecord:
        topic = getattr(pipeline.names, role)
        node = await probe.leader(topic, partition)
        ask = lambda: probe.leader(topic, partition)  # noqa: E731
        return await _down_and_up(pipeline, probe, f"kill leader of {role}[{partition}]", node, "",
                                  lambda: _until_other(probe, ask, node))
    return fault


def kill_grouping_coordinator(partition: int) -> Fault:
    async def fault(pipeline: Pipeline, probe: ClusterProbe) -> FaultRecord:
        txn = f"{pipeline.names.group_id('grouping')}.p{partition}"
        node = await probe.transaction_coordinator(txn)
        ask = lambda: probe.transaction_coordinator(txn)  # noqa: E731
        return await _down_and_up(pipeline, probe, "kill transaction coordinator of grouping", node, txn,
                                  lambda: _until_other(probe, ask, node))
    return fault


async def kill_controller(pipeline: Pipeline, probe: ClusterProbe) -> FaultRecord:
    node = await probe.active_controller()
    return await _down_and_up(pipeline, probe, "kill active controller", node, "",
                              lambda: _until_other(probe, probe.active_controller, node))


def kill_tier(name: str) -> Fault:
    async def fault(pipeline: Pipeline, probe: ClusterProbe) -> FaultRecord:
        record = FaultRecord(f"kill tier {name}", None, pipeline.progress())
        began = time.monotonic()
        process = pipeline.tiers[name]
        process.kill()
        await pipeline.sleep(1.0)
        process.start()
        record.seconds = time.monotonic() - began
        return record
    return fault


async def rolling_restart(pipeline: Pipeline, probe: ClusterProbe) -> FaultRecord:
    record = FaultRecord("rolling restart of nodes 1, 2, 3", None, pipeline.progress())
    began = time.monotonic()
    steps = []
    for node in sorted(probe.cluster.nodes):
        step = time.monotonic()
        probe.say(f"rolling restart: node {node} restarting")
        await pipeline.in_thread(lambda n=node: probe.cluster.restart_node(n), 240, f"node {node} to restart")
        probe.say(f"rolling restart: node {node} up; waiting for full ISR")
        await probe.wait_fully_replicated()
        steps.append(f"node {node} {time.monotonic() - step:.0f}s")
    record.seconds, record.detail = time.monotonic() - began, ", ".join(steps)
    return record


async def partition_node(pipeline: Pipeline, probe: ClusterProbe) -> FaultRecord:
    topic = pipeline.names.scored
    node = await probe.leader(topic, 0)
    record = FaultRecord("network partition (SIGSTOP) of the leader of scored[0]", node, pipeline.progress())
    began = time.monotonic()
    probe.cluster.pause_node(node)
    probe.say(f"node {node} paused (SIGSTOP)")
    try:
        # the others fence it after the broker session (4 s) and elect new leaders
        taker = await _until_other(probe, lambda: probe.leader(topic, 0), node, timeout=PARTITION_SECONDS + 30)
        record.detail = f"scored[0] led by node {taker} {time.monotonic() - began:.1f}s after the cut"
        await pipeline.sleep(max(0.0, PARTITION_SECONDS - (time.monotonic() - began)))
    finally:
        probe.cluster.resume_node(node)
    probe.say(f"node {node} resumed (SIGCONT); waiting for full ISR")
    assert taker != node, "the paused node kept the leadership of scored[0]"
    await probe.wait_fully_replicated()
    record.seconds = time.monotonic() - began
    return record


# (progress reached, fault): a node fault takes 15-45 s, so they mostly run back to back
SCHEDULE: list[tuple[float, Fault]] = [
    (0.02, kill_leader("prompts", 0)),
    (0.05, kill_tier("reward")),
    (0.08, kill_leader("scored", 1)),
    (0.12, kill_grouping_coordinator(0)),
    (0.18, kill_controller),
    (0.22, kill_tier("grouping-0")),
    (0.25, rolling_restart),
    (0.45, partition_node),
]


async def run_schedule(pipeline: Pipeline, probe: ClusterProbe, timeline: Timeline) -> list[FaultRecord]:
    """Each fault of :data:`SCHEDULE` at its point of progress, the trainer held while it lasts."""
    faults: list[FaultRecord] = []
    for number, (at, fault) in enumerate(SCHEDULE, 1):
        timeline.step(f"fault {number}/{len(SCHEDULE)}: waiting for {at:.0%} of the groups to end")
        await pipeline.wait_for(lambda at=at: pipeline.progress() >= at, 240, f"{at:.0%} ended")
        pipeline.hold_versions = True
        try:
            faults.append(await fault(pipeline, probe))
        finally:
            pipeline.hold_versions = False
        timeline.step(f"fault {number}/{len(SCHEDULE)}: {faults[-1].line()}")
    return faults


def felt(pipeline: Pipeline) -> dict[str, str]:
    """Per tier, how the faults reached it: errors the Kafka client retried by itself (leader
    or coordinator gone, a node not ready; logged as aiokafka warnings) and transactions that
    failed and were retried with a new producer (the transactional core logs each one)."""
    return {name: f"{len(p.grep('WARNING aiokafka'))} client retries, "
                  f"{len(p.grep('its producer is replaced'))} transactions redone"
            for name, p in pipeline.tiers.items()}


def report(out: Outcome, faults: list[FaultRecord], budget: BudgetWatch, max_staleness: int,
           retried: dict[str, str]) -> str:
    return "\n".join([
        f"== exactly once on a 3-node cluster ({out.prompts} prompts x 4)",
        f"admitted {out.admitted} (prompt records {out.prompt_records}), emitted {out.emitted}, "
        f"dropped {sum(out.dropped.values())} by reason {out.dropped or {}}",
        f"duplicates: tasks {out.duplicate_tasks}, rows {out.duplicate_rows}; problems {out.problems or 'none'}; "
        f"samples on episodes {out.episode_records} (distinct {out.distinct_samples})",
        f"staleness: worst admitted-dropped-capacity {budget.worst} over {budget.samples} samples "
        f"({budget.unreadable} unreadable) at {budget.worst_sample}; max emitted batch staleness {max_staleness}",
        f"versions {out.versions}; budget {out.budget}; tier kills {out.kills}; restarts {out.restarts}; "
        f"unexpected exits {out.unexpected_exits or 'none'}",
        f"faults felt per tier: {retried}",
        *(f"fault: {f.line()}" for f in faults),
        f"took {out.seconds:.0f}s",
    ])


@pytest.mark.timeout(120)
async def test_topics_on_the_cluster_are_replicated_and_weak_settings_are_logged(
    kafka_cluster: LocalKafkaCluster, unique_name: str, caplog: pytest.LogCaptureFixture,
) -> None:
    durable = KafkaConfig(bootstrap_servers=kafka_cluster.bootstrap, partitions=2, replication_factor=3)
    names = TopicNames(unique_name, "t0")
    with caplog.at_level(logging.WARNING, logger="rollstream.kafka.admin"):
        await ensure_topics(durable, names)
        await ensure_topics(durable, names)  # and checked, existing
    assert not [r.message for r in caplog.records if "topic check" in r.message]
    admin = make_admin(durable, "test")
    await admin.start()
    try:
        internal = await admin.describe_topics(["__consumer_offsets", "__transaction_state"])
        states = await describe_topics(admin, [*names.data_topics(), *names.compacted_topics()])
    finally:
        await admin.close()
    assert len(states) == 7
    assert all(s.replication == 3 and s.configs["min.insync.replicas"] == "2" for s in states.values()), states
    assert all(len(part["replicas"]) == 3 for topic in internal for part in topic["partitions"])
    weak = KafkaConfig(bootstrap_servers=kafka_cluster.bootstrap, partitions=2)  # replication 1
    with caplog.at_level(logging.WARNING, logger="rollstream.kafka.admin"):
        await ensure_topics(weak, TopicNames(unique_name + "w", "t0"))
    assert any("kafka.replication_factor=1 on a cluster of 3 brokers" in r.message for r in caplog.records)


@pytest.mark.timeout(600)
async def test_exactly_once_on_a_replicated_cluster_under_node_faults(
    kafka_cluster: LocalKafkaCluster, unique_name: str, tiny_model: Path, tmp_path: Path,
    show_report: ShowReport,
) -> None:
    with LocalRedisServer(tmp_path / "redis", appendonly=True) as redis:
        dataset = write_dataset(tmp_path / "prompts.jsonl", PROMPTS)
        tree = pipeline_config(kafka_cluster.bootstrap, redis.url, unique_name, tiny_model, dataset, PROMPTS)
        tree["kafka"]["replication_factor"] = 3
        tree["grouping"]["drop_stale"] = True
        async with Pipeline(tree, tmp_path, tiny_model, step_seconds=FAULT_STEP_SECONDS) as pipeline:
            timeline = Timeline("cluster")
            probe = ClusterProbe(kafka_cluster, pipeline.config.kafka, say=timeline.step)
            async with BudgetWatch(pipeline.config) as budget:
                for name, tier in TIERS.items():
                    pipeline.add(name, tier, *(["grouping.instance_id=grouping-0"] if tier == "grouping" else []))
                for process in pipeline.tiers.values():
                    process.start()
                timeline.step("tiers started")
                faults = await timeline.within(run_schedule(pipeline, probe, timeline), SCHEDULE_SECONDS,
                                               "the fault schedule")
                finished_before_last_fault = pipeline.finished()
                pipeline.step_seconds = FINAL_STEP_SECONDS
                await pipeline.wait_for(pipeline.finished, FINISH_SECONDS, "every admitted prompt to end")
                timeline.step("every group ended; reading the topics")
                outcome = await pipeline.outcome()
            batches = await read_topic(pipeline.config.kafka, pipeline.names.batches, decode_group)
    max_staleness = max((b.staleness for b in batches if isinstance(b, EmittedGroup)), default=0)
    text = report(outcome, faults, budget, max_staleness, felt(pipeline))
    show_report(text)
    assert not outcome.problems, "\n".join(outcome.problems) + "\n" + text
    assert outcome.admitted == PROMPTS and outcome.emitted + sum(outcome.dropped.values()) == PROMPTS, text
    assert outcome.duplicate_tasks == 0 and outcome.duplicate_rows == 0, text
    assert outcome.budget["admitted"] == PROMPTS, text  # one slot per prompt, none lost or doubled
    assert budget.samples > 100 and budget.worst is not None and budget.worst <= 0, text
    assert max_staleness <= pipeline.config.staleness.max_head_offpolicyness, text
    assert not outcome.unexpected_exits, text
    assert not finished_before_last_fault, "the run ended before its last fault: nothing was under load\n" + text
    assert len(faults) == len(SCHEDULE) and all(f.progress < 1.0 for f in faults), text

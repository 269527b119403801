"""The rollout worker tier: prompts in, one message per sample out on ``episodes``.

``run(config, stop)`` wires the pieces: the prompt consumer (group ``rollout-worker``,
read_committed, manual commits, sticky assignment), the prompt claims in Redis
(``rollout_workers/claims.py``: whoever reads a prompt again never re-runs one a live worker
runs), an idempotent producer, the engine, the workflow allow-list and the
:class:`VersionFollower`. The loop takes prompt records while fewer than twice
``rollout.max_concurrent_rollouts`` samples are in flight (as many generate, the others wait for
a slot: ``prompt_intake.py``; partitions are paused, not left
unpolled, when full, so the worker stays in its group during long generations), asks again
about prompts other workers hold, commits finished prompts every
``rollout.commit_interval_seconds``, and re-raises the first failure of any background task.
A dead worker is noticed after ``rollout.failure_detection_seconds`` (the consumer session and
the claims' liveness): only then are its running prompts run again.

When ``stop`` is set it stops taking prompts, commits what is done and LEAVES the group at
once (its partitions move to the other workers, who wait for its claims), then lets its
in-flight prompts finish for up to ``rollout.shutdown_grace_seconds``; what is still running
then is cancelled and its claims released, so the partitions' new owners run it at once.
An offset is never committed before all samples of its prompt (and of every prompt before it
on the partition) are acknowledged by the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time

from aiokafka import AIOKafkaConsumer

from rollstream.areal.stats import export_periodically
from rollstream.config import RollstreamConfig
from rollstream.dump.lines import DumpWriter
from rollstream.runtime.health import mark_ready
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.assignors import rollout_assignors
from rollstream.kafka.clients import make_consumer, make_producer, start_client, stop_client
from rollstream.kafka.partition_loop import AtLeastOnce, PartitionLoop
from rollstream.kafka.topics import TopicNames
from rollstream.runtime.metrics import WEIGHT_VERSION
from rollstream.runtime.tasks import cancel_and_wait
from rollstream.state.client import RedisKeys, connect, wait_for_redis
from rollstream.state.version_store import VersionStore
from rollstream.retry import KAFKA_RETRY
from rollstream.rollout_workers.claims import PromptClaims
from rollstream.rollout_workers.prompt_intake import PromptIntake
from rollstream.rollout_workers.engine_factory import build_engine, build_follower, load_tokenizer
from rollstream.rollout_workers.offsets import OffsetTracker
from rollstream.rollout_workers.registry import WorkflowRegistry
from rollstream.rollout_workers.runner import TIER, PromptRunner

log = logging.getLogger(__name__)

FETCH_TIMEOUT_MS = 200
# How long a rebalance waits for a member to rejoin (aiokafka's default is the session timeout,
# rollout.failure_detection_seconds). A member rejoins after its revoke callback, which waits
# for the fetch in hand and commits what it finished; a member later than this is left out of
# the round and its JoinGroup starts the next one. Crashes are still found by the session
# timeout; only a member that dies in the middle of a rebalance holds that round up to this long.
REBALANCE_TIMEOUT_MS = 60_000
FETCH_MAX_RECORDS = 4  # few at a time: prompts are long-running work, not a stream to drain


def worker_id_of(config: RollstreamConfig) -> str:
    """``rollout.worker_id``, default ``<hostname>-<pid>``."""
    return config.rollout.worker_id or f"{socket.gethostname()}-{os.getpid()}"


def make_rollout_consumer(config: RollstreamConfig, worker_id: str) -> AIOKafkaConsumer:
    """The consumer of the prompts topic in the rollout workers' group (not subscribed yet)."""
    names = TopicNames.of(config)
    session_ms = int(config.rollout.failure_detection_seconds * 1000)
    return make_consumer(
        config.kafka, f"rollout-{worker_id}", group_id=names.group_id(TIER), session_timeout_ms=session_ms,
        heartbeat_interval_ms=max(100, session_ms // 3), partition_assignment_strategy=rollout_assignors(),
        rebalance_timeout_ms=max(session_ms, REBALANCE_TIMEOUT_MS),
    )


async def run(config: RollstreamConfig, stop: asyncio.Event) -> None:
    """Run the rollout worker until ``stop`` is set (see the module docstring)."""
    rollout = config.rollout
    worker_id = worker_id_of(config)
    names = TopicNames.of(config)
    engine = build_engine(rollout)
    tokenizer = load_tokenizer(rollout)
    registry = WorkflowRegistry.from_config(rollout, tokenizer)
    tracker = OffsetTracker()
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(registry.aclose)
        await ensure_topics(config.kafka, names)
        redis = connect(config.redis)
        stack.push_async_callback(redis.aclose)
        if not await wait_for_redis(redis, stop):
            log.info("stop requested while waiting for redis")
            return
        keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
        store = VersionStore(redis, keys)
        await engine.start()
        stack.push_async_callback(engine.close)
        if registry.endpoint is not None:  # agent workflows: their OpenAI-compatible endpoint
            await registry.endpoint.start()
        follower = build_follower(rollout, engine, store, redis, keys, worker_id)
        WEIGHT_VERSION.labels(TIER).set(await follower.catch_up())

        producer = make_producer(config.kafka, f"rollout-{worker_id}")
        await start_client(producer, config.kafka, f"the producer of rollout worker {worker_id}")
        stack.push_async_callback(stop_client, producer, f"the producer of rollout worker {worker_id}")
        claims = PromptClaims(redis, keys, worker_id, rollout.failure_detection_seconds)
        await claims.register()
        stack.push_async_callback(claims.retire)
        alive = asyncio.create_task(claims.maintain(), name="claims-upkeep")
        stack.push_async_callback(cancel_and_wait, alive)
        dump = DumpWriter.from_config(config, tokenizer, versions=store) if rollout.dump_to_file else None
        if dump is not None:
            stack.push_async_callback(dump.close)  # flushes the last lines
        runner = PromptRunner(
            producer=producer, names=names, registry=registry, engine=engine, tracker=tracker, claims=claims,
            worker_id=worker_id, max_concurrent_rollouts=rollout.max_concurrent_rollouts, dump=dump,
            max_message_bytes=config.kafka.max_message_bytes,
        )
        consumer = make_rollout_consumer(config, worker_id)
        follower_task = asyncio.create_task(follower.run(), name="version-follower")
        stack.push_async_callback(cancel_and_wait, follower_task)
        stats = asyncio.create_task(export_periodically(), name="areal-stats")  # AReaL's tracker never grows
        stack.push_async_callback(cancel_and_wait, stats)
        watched = {"the version follower": follower_task, "the claims' upkeep": alive, "the statistics export": stats}
        intake = PromptIntake(runner, tracker, names.prompts, rollout.max_concurrent_rollouts, watched,
                              consumer.end_offsets)
        delivery = AtLeastOnce(intake, commit_interval=rollout.commit_interval_seconds, retry=KAFKA_RETRY,
                               name=f"rollout worker {worker_id}")
        loop = PartitionLoop(consumer=consumer, topic=names.prompts, delivery=delivery, poll_timeout_ms=FETCH_TIMEOUT_MS,
                             max_records=FETCH_MAX_RECORDS, name=f"rollout worker {worker_id}")
        loop.subscribe()
        await start_client(consumer, config.kafka, f"the consumer of rollout worker {worker_id}")
        stack.push_async_callback(stop_client, consumer, f"the consumer of rollout worker {worker_id}")
        log.info("rollout worker %s (incarnation %s) consuming %s as group %s", worker_id, claims.incarnation,
                 names.prompts, names.group_id(TIER))
        mark_ready()
        try:
            await loop.run(stop)  # its last cycle commits what is done
        except BaseException:
            await runner.tasks.cancel_all()  # a crash commits nothing more
            raise
        log.info("stop requested: taking no more prompts")
        await stop_client(consumer, f"the consumer of rollout worker {worker_id}")  # leave the group now
        log.info("left the group; other workers take the partitions and wait for this worker's claims")
        await _drain(runner, rollout.shutdown_grace_seconds)
    log.info("rollout worker %s stopped", worker_id)


async def _drain(runner: PromptRunner, grace_seconds: float) -> None:
    """Graceful stop: let in-flight prompts finish (bounded); give the rest back."""
    if len(runner.tasks):
        log.info("waiting up to %.0fs for %d in-flight samples", grace_seconds, runner.inflight_samples)
        deadline = time.monotonic() + grace_seconds
        while len(runner.tasks) and time.monotonic() < deadline and runner.tasks.error is None:
            await runner.tasks.wait(min(1.0, max(0.0, deadline - time.monotonic())))
    if len(runner.tasks):
        log.warning("%d prompts still running after the grace period: cancelled; the partitions' owners run "
                    "them again", len(runner.tasks))
        await runner.tasks.cancel_all()
    await runner.release_unfinished()
    runner.tasks.raise_if_failed()

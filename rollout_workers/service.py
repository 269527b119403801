"""The rollout worker tier: prompts in, one message per sample out on ``episodes``.

``run(config, stop)`` wires the pieces: the prompt consumer (group ``rollout-worker``,
read_committed, manual commits, sticky assignment), the prompt claims in Redis
(``rollout_workers/claims.py``: whoever reads a prompt again never re-runs one a live worker
runs), an idempotent producer, the engine, the workflow allow-list and the
:class:`VersionFollower`. The loop takes prompt records while fewer than
``rollout.max_concurrent_rollouts`` samples are in flight (partitions are paused, not left
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
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.assignors.sticky.sticky_assignor import StickyPartitionAssignor
from redis.asyncio import Redis

from rollstream.config import RollstreamConfig
from rollstream.dump import DumpWriter
from rollstream.health import mark_ready
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer, make_producer
from rollstream.kafka.ownership import PartitionOwnership
from rollstream.kafka.topics import TopicNames
from rollstream.metrics import WEIGHT_VERSION
from rollstream.redis_state import RedisKeys, VersionStore, connect, wait_for_redis
from rollstream.rollout_workers.claims import PromptClaims
from rollstream.rollout_workers.commits import OffsetCommitter, prompt_ownership
from rollstream.rollout_workers.engine_factory import build_engine, build_follower, load_tokenizer
from rollstream.rollout_workers.offsets import OffsetTracker
from rollstream.rollout_workers.registry import WorkflowRegistry
from rollstream.rollout_workers.runner import TIER, PromptRunner

log = logging.getLogger(__name__)

FETCH_TIMEOUT_MS = 200
FETCH_MAX_RECORDS = 4  # few at a time: prompts are long-running work, not a stream to drain
RECHECK_SECONDS = 1.0  # how often prompts held by other workers are asked about again
# sticky first: a rebalance leaves partitions where they are when it can; round robin for
# members of an older version during a rolling upgrade
ASSIGNORS = (StickyPartitionAssignor, RoundRobinPartitionAssignor)


def worker_id_of(config: RollstreamConfig) -> str:
    """``rollout.worker_id``, default ``<hostname>-<pid>``."""
    return config.rollout.worker_id or f"{socket.gethostname()}-{os.getpid()}"


async def run(config: RollstreamConfig, stop: asyncio.Event) -> None:
    """Run the rollout worker until ``stop`` is set (see the module docstring)."""
    rollout = config.rollout
    worker_id = worker_id_of(config)
    names = TopicNames(config.experiment.experiment_name, config.experiment.trial_name)
    engine = build_engine(rollout)
    tokenizer = load_tokenizer(rollout)
    registry = WorkflowRegistry.from_config(rollout, tokenizer)
    tracker = OffsetTracker()
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(registry.aclose)
        await ensure_topics(config.kafka, names)
        redis = connect(config.redis)
        stack.push_async_callback(redis.aclose)
        if not await _redis_ready(redis, stop):
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
        await producer.start()
        stack.push_async_callback(producer.stop)
        claims = PromptClaims(redis, keys, worker_id, rollout.failure_detection_seconds)
        await claims.register()
        stack.push_async_callback(claims.retire)
        alive = asyncio.create_task(claims.keep_alive(), name="claims-liveness")
        stack.push_async_callback(_cancel, alive)
        dump = DumpWriter.from_config(config, tokenizer, versions=store) if rollout.dump_to_file else None
        if dump is not None:
            stack.push_async_callback(dump.close)  # flushes the last lines
        runner = PromptRunner(
            producer=producer, names=names, registry=registry, engine=engine, tracker=tracker, claims=claims,
            worker_id=worker_id, max_concurrent_rollouts=rollout.max_concurrent_rollouts, dump=dump,
            max_message_bytes=config.kafka.max_message_bytes,
        )
        session_ms = int(rollout.failure_detection_seconds * 1000)
        consumer = make_consumer(
            config.kafka, f"rollout-{worker_id}", group_id=names.group_id(TIER), session_timeout_ms=session_ms,
            heartbeat_interval_ms=max(100, session_ms // 3), partition_assignment_strategy=ASSIGNORS,
        )
        committer = OffsetCommitter(consumer, tracker)
        ownership = prompt_ownership(consumer, names.prompts, committer, tracker, runner.forget,
                                     f"rollout worker {worker_id}")
        consumer.subscribe([names.prompts], listener=ownership)
        await consumer.start()
        stack.push_async_callback(consumer.stop)
        follower_task = asyncio.create_task(follower.run(), name="version-follower")
        stack.push_async_callback(_cancel, follower_task)
        log.info("rollout worker %s (incarnation %s) consuming %s as group %s", worker_id, claims.incarnation,
                 names.prompts, names.group_id(TIER))
        mark_ready()
        try:
            await _consume(consumer, ownership, runner, committer, follower_task, stop, config)
        except BaseException:
            await runner.tasks.cancel_all()  # a crash commits nothing more
            raise
        await _leave(consumer, committer)
        await _drain(runner, rollout.shutdown_grace_seconds)
    log.info("rollout worker %s stopped", worker_id)


async def _redis_ready(redis: Redis, stop: asyncio.Event) -> bool:
    """Wait for Redis; False when ``stop`` was set meanwhile (a clean exit, not an error)."""
    try:
        await wait_for_redis(redis, stop)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if stop.is_set() and current is not None and not current.cancelling():
            log.info("stop requested while waiting for redis")
            return False
        raise
    return True


async def _consume(
    consumer: AIOKafkaConsumer,
    ownership: PartitionOwnership,
    runner: PromptRunner,
    committer: OffsetCommitter,
    follower_task: asyncio.Task[None],
    stop: asyncio.Event,
    config: RollstreamConfig,
) -> None:
    limit = config.rollout.max_concurrent_rollouts
    interval = config.rollout.commit_interval_seconds
    next_commit = time.monotonic() + interval
    next_recheck = time.monotonic() + RECHECK_SECONDS
    while not stop.is_set():
        runner.tasks.raise_if_failed()
        ownership.raise_error()
        _check_follower(follower_task)
        room = limit - runner.inflight_samples - runner.claiming
        async with ownership.lock:
            _pause_when_full(consumer, ownership, full=room <= 0)
        timeout_ms = FETCH_TIMEOUT_MS
        if room <= 0:
            await runner.wait_for_room(FETCH_TIMEOUT_MS / 1000)
            timeout_ms = 0  # paused: this poll only keeps the member alive in its group
        # A record holds group_size samples; taking at most ``room`` records keeps the
        # backlog (work a crash would redo) small.
        max_records = max(1, min(FETCH_MAX_RECORDS, room))
        fetched = await consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        snapshot = ownership.snapshot()  # no await since getmany returned
        async with ownership.lock:
            for records in ownership.accept(fetched, snapshot).values():
                for record in records:
                    runner.take(record)
        if runner.held and time.monotonic() >= next_recheck:
            await runner.recheck_held({tp for tp in consumer.assignment() if tp.partition in ownership.owned})
            next_recheck = time.monotonic() + RECHECK_SECONDS
        if time.monotonic() >= next_commit:
            await committer.advance_positions()
            await committer.commit()
            next_commit = time.monotonic() + interval
    log.info("stop requested: taking no more prompts")


def _check_follower(task: asyncio.Task[None]) -> None:
    if task.done():
        task.result()  # re-raises its error
        raise RuntimeError("the version follower ended unexpectedly")


def _pause_when_full(consumer: AIOKafkaConsumer, ownership: PartitionOwnership, full: bool) -> None:
    """Pause fetching while at capacity; polling goes on so the group keeps this member.
    Only partitions this worker owns are resumed (the guard pauses the others)."""
    if full:
        assigned = consumer.assignment()
        if assigned and consumer.paused() != assigned:
            consumer.pause(*assigned)
    elif consumer.paused():
        owned = [tp for tp in consumer.paused() if tp.partition in ownership.owned]
        if owned:
            consumer.resume(*owned)


async def _leave(consumer: AIOKafkaConsumer, committer: OffsetCommitter) -> None:
    """Commit what is done, then leave the group: the partitions move to the other workers
    now, and they wait for this worker's claims instead of re-running its prompts."""
    await committer.advance_positions()
    committed = await committer.commit()
    await consumer.stop()
    log.info("left the group (committed %s); other workers take the partitions",
             {f"{tp.topic}[{tp.partition}]": o for tp, o in committed.items()} or "nothing new")


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


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

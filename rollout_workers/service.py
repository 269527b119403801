"""The rollout worker tier: prompts in, one message per sample out on ``episodes``.

``run(config, stop)`` wires the pieces: the prompt consumer (group ``rollout-worker``,
read_committed, manual commits), an idempotent producer, the engine, the workflow allow-list
and the :class:`VersionFollower`. The loop takes prompt records while fewer than
``rollout.max_concurrent_rollouts`` samples are in flight (partitions are paused, not left
unpolled, when full, so the worker stays in its group during long generations), commits
finished prompts every ``rollout.commit_interval_seconds``, and re-raises the first failure of
any background task.

When ``stop`` is set it stops taking prompts, waits up to ``rollout.shutdown_grace_seconds``
for in-flight samples, cancels the rest (their prompts are re-run by the next owner), commits,
and closes every client. An offset is never committed before all samples of its prompt (and
of every prompt before it on the partition) are acknowledged by the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time

from aiokafka import AIOKafkaConsumer
from redis.asyncio import Redis

from rollstream.config import RollstreamConfig
from rollstream.dump import DumpWriter
from rollstream.health import mark_ready
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer, make_producer, start_client
from rollstream.kafka.ownership import PartitionOwnership
from rollstream.kafka.topics import TopicNames
from rollstream.metrics import WEIGHT_VERSION
from rollstream.redis_state import RedisKeys, VersionStore, connect, wait_for_redis
from rollstream.rollout_workers.commits import OffsetCommitter, prompt_ownership
from rollstream.rollout_workers.engine_factory import build_engine, build_follower, load_tokenizer
from rollstream.rollout_workers.offsets import OffsetTracker
from rollstream.rollout_workers.registry import WorkflowRegistry
from rollstream.rollout_workers.runner import TIER, PromptRunner

log = logging.getLogger(__name__)

FETCH_TIMEOUT_MS = 200
FETCH_MAX_RECORDS = 4  # few at a time: prompts are long-running work, not a stream to drain


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
        await start_client(producer, config.kafka, f"the producer of rollout worker {worker_id}")
        stack.push_async_callback(producer.stop)
        consumer = make_consumer(config.kafka, f"rollout-{worker_id}", group_id=names.group_id(TIER))
        committer = OffsetCommitter(consumer, tracker)
        ownership = prompt_ownership(consumer, names.prompts, committer, tracker, f"rollout worker {worker_id}")
        consumer.subscribe([names.prompts], listener=ownership)
        await start_client(consumer, config.kafka, f"the consumer of rollout worker {worker_id}")
        stack.push_async_callback(consumer.stop)
        dump = DumpWriter.from_config(config, tokenizer, versions=store) if rollout.dump_to_file else None
        if dump is not None:
            stack.push_async_callback(dump.close)  # flushes the last lines
        runner = PromptRunner(
            producer=producer, names=names, registry=registry, engine=engine, tracker=tracker,
            worker_id=worker_id, max_concurrent_rollouts=rollout.max_concurrent_rollouts, dump=dump,
            max_message_bytes=config.kafka.max_message_bytes,
        )
        follower_task = asyncio.create_task(follower.run(), name="version-follower")
        stack.push_async_callback(_cancel, follower_task)
        log.info("rollout worker %s consuming %s as group %s", worker_id, names.prompts, names.group_id(TIER))
        mark_ready()
        try:
            await _consume(consumer, ownership, runner, committer, follower_task, stop, config)
        except BaseException:
            await runner.tasks.cancel_all()  # a crash commits nothing more
            raise
        await _drain(runner, committer, rollout.shutdown_grace_seconds)
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
    while not stop.is_set():
        runner.tasks.raise_if_failed()
        ownership.raise_error()
        _check_follower(follower_task)
        room = limit - runner.inflight_samples
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


async def _drain(runner: PromptRunner, committer: OffsetCommitter, grace_seconds: float) -> None:
    """Graceful stop: let in-flight samples finish (bounded), then commit what is done."""
    if len(runner.tasks):
        log.info("waiting up to %.0fs for %d in-flight samples", grace_seconds, runner.inflight_samples)
        deadline = time.monotonic() + grace_seconds
        while len(runner.tasks) and time.monotonic() < deadline and runner.tasks.error is None:
            await runner.tasks.wait(min(1.0, max(0.0, deadline - time.monotonic())))
    if len(runner.tasks):
        log.warning("%d prompts still running after the grace period: cancelled, the next owner re-runs them",
                    len(runner.tasks))
        await runner.tasks.cancel_all()
    await committer.advance_positions()
    committed = await committer.commit()
    log.info("final commit: %s", {f"{tp.topic}[{tp.partition}]": o for tp, o in committed.items()} or "nothing new")
    runner.tasks.raise_if_failed()


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

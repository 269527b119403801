"""The rollout worker tier: prompts in, one message per sample out on ``episodes``.

:func:`build` makes its pieces: the prompt consumer (sticky assignment), the prompt claims in Redis
(``rollout_workers/claims.py``: whoever reads a prompt again never re-runs one a live worker
runs), an idempotent producer, the engine, the workflow allow-list and the
:class:`VersionFollower`. The loop takes prompt records while fewer than twice
``rollout.max_concurrent_rollouts`` samples are in flight (as many generate, the others wait for
a slot: ``prompt_intake.py``), asks again
about prompts other workers hold, commits finished prompts every
``rollout.commit_interval_seconds``, and re-raises the first failure of any background task.
A dead worker is noticed after ``rollout.failure_detection_seconds`` (the consumer session and
the claims' liveness): only then are its running prompts run again.

When ``stop`` is set it stops taking prompts, commits what is done and LEAVES the group at
once (its partitions move to the other workers, who wait for its claims), then lets its
in-flight prompts finish for up to ``rollout.shutdown_grace_seconds``; what is still running
then is cancelled and its claims released, so the new partition owners run it at once.
An offset is never committed before all samples of its prompt (and of every prompt before it
on the partition) are acknowledged by the broker.
"""

from __future__ import annotations

import logging
import time

from rollstream.areal.stats import export_periodically
from rollstream.config import RollstreamConfig
from rollstream.dump.lines import DumpWriter
from rollstream.kafka.assignors import rollout_assignors
from rollstream.runtime.metrics import WEIGHT_VERSION
from rollstream.state.version_store import VersionStore
from rollstream.rollout_workers.claims import PromptClaims
from rollstream.rollout_workers.prompt_intake import PromptIntake
from rollstream.rollout_workers.engine_factory import build_engine, build_follower, load_tokenizer
from rollstream.rollout_workers.offsets import OffsetTracker
from rollstream.rollout_workers.registry import WorkflowRegistry
from rollstream.rollout_workers.runner import TIER, PromptRunner
from rollstream.tier.context import TierContext
from rollstream.tier.declaration import AT_LEAST_ONCE, Reads, Tier, default_instance
from rollstream.tier.runtime import entry

log = logging.getLogger(__name__)

FETCH_TIMEOUT_MS = 200
# How long a rebalance waits for a member to rejoin (aiokafka's default is the session timeout,
# rollout.failure_detection_seconds). A member rejoins after its revoke callback, which waits
# for the fetch in hand and commits what it finished; a member later than this is left out of
# the round and its JoinGroup starts the next one. Crashes are still found by the session
# timeout; only a member that dies in the middle of a rebalance holds that round up to this long.
REBALANCE_TIMEOUT_MS = 60_000
FETCH_MAX_RECORDS = 4  # few at a time: prompts are long-running work, not a stream to drain


def declare(config: RollstreamConfig) -> Tier:
    rollout = config.rollout
    session_ms = int(rollout.failure_detection_seconds * 1000)
    options = {"partition_assignment_strategy": rollout_assignors(),
               "rebalance_timeout_ms": max(session_ms, REBALANCE_TIMEOUT_MS)}
    reads = Reads("prompts", poll_timeout_ms=FETCH_TIMEOUT_MS, max_records=FETCH_MAX_RECORDS,
                  session_timeout_ms=session_ms, consumer_options=options)
    return Tier(TIER, rollout.worker_id or default_instance(), reads, ("episodes",), AT_LEAST_ONCE, build,
                commit_interval_seconds=rollout.commit_interval_seconds, drain_seconds=rollout.shutdown_grace_seconds)


async def build(ctx: TierContext) -> PromptIntake:
    """The engine, the workflows, the claims, the version follower and the runner (module docstring)."""
    rollout, worker_id = ctx.config.rollout, ctx.tier.instance
    engine = build_engine(rollout)
    tokenizer = load_tokenizer(rollout)
    registry = WorkflowRegistry.from_config(rollout, tokenizer)
    ctx.on_close("closing the workflows", registry.aclose)
    redis = await ctx.redis(wait=True)
    store = VersionStore(redis, ctx.keys)
    ctx.phase = "starting the engine"
    await engine.start()
    ctx.on_close("closing the engine", engine.close)
    if registry.endpoint is not None:  # agent workflows: their OpenAI-compatible endpoint
        await registry.endpoint.start()
    follower = build_follower(rollout, engine, store, redis, ctx.keys, worker_id)
    ctx.phase = "catching up with the trainer's version"
    WEIGHT_VERSION.labels(TIER).set(await follower.catch_up())
    producer = await ctx.producer()
    claims = PromptClaims(redis, ctx.keys, worker_id, rollout.failure_detection_seconds)
    await claims.register()
    ctx.on_close("retiring the prompt claims", claims.retire)
    ctx.background("the claims' upkeep", claims.maintain())
    dump = DumpWriter.from_config(ctx.config, tokenizer, versions=store) if rollout.dump_to_file else None
    if dump is not None:
        ctx.on_close("flushing the dump files", dump.close)
    tracker = OffsetTracker()
    runner = PromptRunner(
        producer=producer, names=ctx.names, registry=registry, engine=engine, tracker=tracker, claims=claims,
        worker_id=worker_id, max_concurrent_rollouts=rollout.max_concurrent_rollouts, dump=dump,
        max_message_bytes=ctx.config.kafka.max_message_bytes,
    )
    ctx.background("the version follower", follower.run())
    ctx.background("the statistics export", export_periodically())  # AReaL's tracker never grows
    ctx.on_failure(runner.tasks.cancel_all)  # a crash commits nothing more
    ctx.after_leaving(lambda seconds: _drain(runner, seconds))
    log.info("%s is incarnation %s of its prompt claims", ctx.tier.label, claims.incarnation)
    assert ctx.consumer is not None
    return PromptIntake(runner, tracker, ctx.names.prompts, rollout.max_concurrent_rollouts, ctx.watched,
                        ctx.consumer.end_offsets)


run = entry(declare)


async def _drain(runner: PromptRunner, grace_seconds: float) -> None:
    """Graceful stop: let in-flight prompts finish (bounded); give the rest back."""
    if len(runner.tasks):
        log.info("waiting up to %.0fs for %d in-flight samples", grace_seconds, runner.inflight_samples)
        deadline = time.monotonic() + grace_seconds
        while len(runner.tasks) and time.monotonic() < deadline and runner.tasks.error is None:
            await runner.tasks.wait(min(1.0, max(0.0, deadline - time.monotonic())))
    if len(runner.tasks):
        log.warning("%d prompts still running after the grace period: cancelled; the new partition owners run "
                    "them again", len(runner.tasks))
        await runner.tasks.cancel_all()
    await runner.release_unfinished()
    runner.tasks.raise_if_failed()

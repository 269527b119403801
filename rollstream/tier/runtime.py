"""The one tier runtime: runs a declared :class:`~rollstream.tier.declaration.Tier`.

In order: the consumer is made (not started); the trial's topics are checked (created when
missing, the tier's own roles too); the tier builds its part from a
:class:`~rollstream.tier.context.TierContext`; the runtime wraps the part in its delivery
(:class:`~rollstream.kafka.consume_transform_produce.ExactlyOnce` with one transactional
producer per input partition, or :class:`~rollstream.kafka.partition_loop.AtLeastOnce`),
runs the :class:`~rollstream.kafka.partition_loop.PartitionLoop` until ``stop`` (its last
cycle commits), leaves the consumer group at once, runs the tier's drains, and closes every
resource in reverse order. A source tier builds a
:class:`~rollstream.tier.declaration.Source` and runs it instead. ``/readyz`` turns ready when
the tier consumes (a source: when it starts). The whole shutdown is bounded:
``shutdown_timeout_seconds`` plus the tier's drain (:mod:`rollstream.tier.shutdown_bound`).
A stop asked while the tier still starts (its topics, its build, its consumer: each may wait
minutes for the broker, Redis or a server) cuts the start short at once, closes what was made
and ends the tier cleanly: there is nothing to finish yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer

from rollstream.config import RollstreamConfig
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer, start_client, stop_client
from rollstream.kafka.consume_transform_produce import ExactlyOnce
from rollstream.kafka.partition_loop import AtLeastOnce, PartitionLoop
from rollstream.kafka.topics import TopicNames
from rollstream.kafka.transactions import PartitionProducers
from rollstream.retry import KAFKA_RETRY, transaction_retry
from rollstream.runtime.health import mark_ready
from rollstream.tier.context import StopBeforeReady, TierContext, before_stop
from rollstream.tier.declaration import EXACTLY_ONCE, SOURCE, Declare, Tier
from rollstream.tier.shutdown_bound import bounded_by_stop

log = logging.getLogger(__name__)

TierRun = Callable[[RollstreamConfig, asyncio.Event], Awaitable[Any]]


def entry(declare: Declare) -> TierRun:
    """The ``rollstream.tiers`` entry point of a declared tier: ``async run(config, stop)``."""

    async def run(config: RollstreamConfig, stop: asyncio.Event) -> Any:
        return await serve(declare(config), config, stop)

    return run


async def serve(tier: Tier, config: RollstreamConfig, stop: asyncio.Event) -> Any:
    """Run ``tier`` until it ends or ``stop`` is set (module docstring); a source's result."""
    run = _TierRun(tier, config, stop)
    bound = config.shutdown_timeout_seconds + tier.drain_seconds
    return await bounded_by_stop(run.run(), stop, bound, lambda: run.phase, tier.label)


def topic_names(tier: Tier, config: RollstreamConfig) -> TopicNames:
    """The trial's topics with the roles ``tier`` reads and writes."""
    roles = ([tier.reads.role] if tier.reads else []) + list(tier.writes)
    return TopicNames.of(config).with_roles(roles)


def tier_consumer(tier: Tier, config: RollstreamConfig, names: TopicNames) -> AIOKafkaConsumer:
    """The consumer ``tier`` reads with, in a group of the tier's name (made, not subscribed)."""
    reads = tier.reads
    assert reads is not None, f"{tier.name} is a source: it has no consumer"
    session = reads.session_timeout_ms
    return make_consumer(
        config.kafka, tier.client_id, group_id=names.group_id(tier.name), read_committed=reads.read_committed,
        max_poll_records=reads.max_records or 500, session_timeout_ms=session,
        heartbeat_interval_ms=max(100, session // reads.heartbeats_per_session), **reads.consumer_options,
    )


class _TierRun:
    def __init__(self, tier: Tier, config: RollstreamConfig, stop: asyncio.Event) -> None:
        self.tier, self.config, self.stop = tier, config, stop
        self.ctx: TierContext | None = None
        self._phase = "checking the trial's topics"

    @property
    def phase(self) -> str:
        return self.ctx.phase if self.ctx is not None else self._phase

    async def run(self) -> Any:
        tier = self.tier
        names = topic_names(tier, self.config)
        async with contextlib.AsyncExitStack() as stack:
            consumer = tier_consumer(tier, self.config, names) if tier.reads else None
            self.ctx = ctx = TierContext(tier, self.config, names, self.stop, stack, consumer)
            if consumer is not None:  # closed however the tier ends, a start cut short too
                what = f"the consumer of {tier.label}"
                ctx.on_close(f"stopping {what}", lambda: stop_client(consumer, what))
            try:
                ctx.phase = "checking the trial's topics"
                await before_stop(ensure_topics(self.config.kafka, names), self.stop, lambda: self.phase)
                ctx.phase = "building"
                part = await before_stop(tier.build(ctx), self.stop, lambda: self.phase)
                if tier.delivery != SOURCE:
                    assert consumer is not None
                    loop = self._loop(ctx, consumer, part)
                    await before_stop(self._start_consumer(ctx, consumer, loop), self.stop, lambda: self.phase)
            except StopBeforeReady as exc:
                log.info("%s: %s; nothing to finish", tier.label, exc)
                return None
            mark_ready()
            ctx.phase = "running"
            if tier.delivery == SOURCE:
                log.info("%s started: %s", tier.label, tier.describe())
                return await part.run(self.stop)
            assert consumer is not None
            await self._consume(ctx, consumer, loop)
        log.info("%s stopped", tier.label)
        return None

    def _loop(self, ctx: TierContext, consumer: AIOKafkaConsumer, part: Any) -> PartitionLoop:
        tier, kafka, reads = self.tier, self.config.kafka, self.tier.reads
        assert reads is not None
        if tier.delivery == EXACTLY_ONCE:
            group_id = ctx.names.group_id(tier.name)
            producers = PartitionProducers(kafka, tier.client_id, base_id=group_id)
            ctx.on_close("closing the transactional producers", producers.close)
            delivery: Any = ExactlyOnce(
                group_id=group_id, producers=producers, transform=part, dead_letter_topic=ctx.names.dead_letter,
                max_record_bytes=kafka.max_message_bytes, name=tier.label,
                retry=transaction_retry(tier.max_consecutive_failures, kafka.outage_patience_seconds),
            )
        else:
            delivery = AtLeastOnce(part, commit_interval=tier.commit_interval_seconds, retry=KAFKA_RETRY,
                                   name=tier.label)
        return PartitionLoop(
            consumer=consumer, topic=ctx.names.topic(reads.role), delivery=delivery,
            poll_timeout_ms=reads.poll_timeout_ms, max_records=reads.max_records, name=tier.label,
            lost_partition_hold_seconds=2 * reads.session_timeout_ms / 1000,  # a lost partition stays fenced
        )

    async def _start_consumer(self, ctx: TierContext, consumer: AIOKafkaConsumer, loop: PartitionLoop) -> None:
        what = f"the consumer of {self.tier.label}"
        loop.subscribe()
        ctx.phase = f"starting {what}"
        await start_client(consumer, self.config.kafka, what)

    async def _consume(self, ctx: TierContext, consumer: AIOKafkaConsumer, loop: PartitionLoop) -> None:
        tier = self.tier
        what = f"the consumer of {tier.label}"
        log.info("%s consuming %s as consumer group %s: %s", tier.label, loop.topic, ctx.names.group_id(tier.name),
                 tier.describe())
        ctx.phase = "consuming"
        try:
            await loop.run(self.stop)  # its last cycle commits what is done
        except BaseException:
            ctx.phase = "stopping its work after a failure"
            for hook in ctx.failure_hooks:
                await hook()
            raise
        ctx.phase = "leaving the consumer group"
        await stop_client(consumer, what)  # its partitions move to the others now
        log.info("left the consumer group: %s's partitions move to the other members", tier.label)
        for drain in ctx.drains:
            ctx.phase = "finishing the work in flight"
            await drain(tier.drain_seconds)
        ctx.phase = "closing"

"""The grouping tier: ``scored`` samples in, exactly one batch or drop per group out.

Each cycle polls ``scored`` (read_committed), feeds a :class:`~consumers.grouping.GroupBuffer`,
and writes what ended, the changelog outcomes and the new input offsets in one transaction
(:mod:`consumers.emission`). The committed input offset of a partition never passes the first
record of a group that has not been emitted, so after a crash or rebalance the new owner
rebuilds open groups by re-reading from it, and skips ended groups via the changelog.

Transactional id: ``<group id>.<grouping.instance_id>``. Keep ``instance_id`` STABLE per
instance (e.g. a StatefulSet ordinal): a restarted instance then fences its dead predecessor
and aborts its open transaction at once, instead of waiting for the transaction timeout. Two
live instances must never share an ``instance_id`` (the older one is fenced and exits).

With ``groups_per_batch > 1`` a partial batch is flushed once its oldest group has waited
``PARTIAL_BATCH_FLUSH_FACTOR * commit_interval_ms`` (1 s by default), and on shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import KafkaError, ProducerFenced
from aiokafka.structs import ConsumerRecord, TopicPartition

from consumers.changelog import read_outcomes
from consumers.emission import CycleOutput, Emitter
from consumers.grouping import CompleteGroup, ConflictError, GroupBuffer, GroupFilters
from consumers.pending import PendingBatches
from consumers.trainer_version import TrainerVersion
from consumers.txn_producer import TransactionalProducer
from rollstream import metrics
from rollstream.config import RollstreamConfig, raise_first_problem
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer
from rollstream.kafka.dead_letter import dead_letter_for
from rollstream.kafka.topics import TopicNames
from rollstream.redis_state import RedisKeys, StalenessBudget, VersionStore, connect
from rollstream.wire import WireDecodeError, decode_scored

log = logging.getLogger(__name__)

TIER = "grouping"
PARTIAL_BATCH_FLUSH_FACTOR = 10
MAX_TRANSACTION_FAILURES = 5  # in a row; then the instance exits loudly


def transactional_id(config: RollstreamConfig, names: TopicNames) -> str:
    return f"{names.group_id(TIER)}.{config.grouping.instance_id}"


def check_config(config: RollstreamConfig) -> None:
    g = config.grouping
    problems = [
        (not g.instance_id, "grouping.instance_id must not be empty"),
        (g.group_timeout_seconds <= 0, "grouping.group_timeout_seconds must be > 0"),
        (g.commit_interval_ms < 1, "grouping.commit_interval_ms must be >= 1"),
        (g.dedupe_window_seconds < 0, "grouping.dedupe_window_seconds must be >= 0"),
        (g.session_timeout_ms < 1000, "grouping.session_timeout_ms must be >= 1000"),
    ]
    raise_first_problem(problems)


class GroupingService:
    """The state and cycle of one grouping instance; the listener and the loop share ``lock``."""

    def __init__(
        self,
        config: RollstreamConfig,
        names: TopicNames,
        txn: TransactionalProducer,
        consumer: AIOKafkaConsumer,
        redis: Any,
    ) -> None:
        g = config.grouping
        self.config, self.names, self.txn, self.consumer = config, names, txn, consumer
        eta = config.staleness.max_head_offpolicyness if g.drop_stale else None
        filters = GroupFilters(drop_equal_rewards=g.drop_equal_rewards, max_head_offpolicyness=eta)
        self.buffer = GroupBuffer(g.group_timeout_seconds, g.dedupe_window_seconds, filters)
        self.pending = PendingBatches(g.groups_per_batch, PARTIAL_BATCH_FLUSH_FACTOR * g.commit_interval_ms / 1000)
        keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
        self.version = TrainerVersion(VersionStore(redis, keys))
        budget = StalenessBudget(redis, keys, config.staleness.max_head_offpolicyness, config.staleness.batch_size)
        self.emitter = Emitter(txn, names, budget, g.pad_value)
        self.lock = asyncio.Lock()
        self.owned: set[int] = set()
        self.committed: dict[int, int] = {}  # partition -> offset committed by this instance
        self.generation = 0  # bumped by every seek to committed offsets: older polls are stale
        self.error: BaseException | None = None
        self.failures = 0  # transactions failed in a row

    # -- rebalance (called by the listener; waits for the in-flight transaction) --

    async def on_assigned(self, partitions: set[int]) -> None:
        async with self.lock:
            try:
                await self._restore(partitions)
                await self._seek_to_committed(partitions)
            except BaseException as exc:  # aiokafka swallows listener errors: hand it to the loop
                self.error = exc
                raise
            self.owned |= partitions
            log.info("%s: assigned scored partitions %s", self.config.grouping.instance_id, sorted(partitions))

    async def on_revoked(self, partitions: set[int]) -> None:
        async with self.lock:
            self._forget(partitions)
            if partitions:
                log.info("%s: revoked scored partitions %s", self.config.grouping.instance_id, sorted(partitions))

    async def _restore(self, partitions: set[int]) -> None:
        outcomes = await read_outcomes(self.config.kafka, self.names.grouping_changelog, partitions)
        loaded = self.buffer.outcomes.restore(outcomes, time.monotonic(), time.time())
        log.info("restored %d group outcomes of partitions %s", loaded, sorted(partitions))

    def _forget(self, partitions: set[int]) -> None:
        self.owned -= partitions
        self.buffer.revoke(partitions)
        self.pending.revoke(partitions)
        for p in partitions:
            self.committed.pop(p, None)
        metrics.OPEN_GROUPS.labels(TIER).set(self.buffer.open_count())

    # -- the loop --

    async def serve(self, stop: asyncio.Event) -> None:
        """Cycle until ``stop``; then one last cycle flushes partial batches and commits."""
        interval = self.config.grouping.commit_interval_ms
        while not stop.is_set():
            self._raise_error()
            fetched = await self.consumer.getmany(timeout_ms=interval)
            generation = self.generation  # taken before any await: see _seek_to_committed
            async with self.lock:
                if generation != self.generation:
                    continue  # polled across a rebalance: re-fetched from the committed offsets
                await self.cycle([r for records in fetched.values() for r in records])
        self._raise_error()
        async with self.lock:
            await self.cycle([], flush_all=True)

    def _raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"grouping: restoring partitions failed: {self.error}") from self.error

    async def cycle(self, records: list[ConsumerRecord], flush_all: bool = False) -> None:
        """Ingest ``records``, decide what ended, and commit it all in one transaction."""
        now = time.monotonic()
        out = CycleOutput()
        records = [r for r in records if r.partition in self.owned]
        version = await self.version.get() if records else self.version.last
        for record in records:
            self._ingest(record, now, version, out)
        out.drops += self.buffer.expire(now)
        out.batches = self.pending.take_ready(now, flush_all)
        out.offsets = self._moved_offsets()
        out.tombstones = self.buffer.outcomes.expired(now, self.committed)
        metrics.OPEN_GROUPS.labels(TIER).set(self.buffer.open_count() + len(self.pending))
        if out.empty():
            return
        if (out.batches or out.drops) and not records:
            version = await self.version.get()
        await self._transact(out, version, now)

    def _ingest(self, record: ConsumerRecord, now: float, version: int, out: CycleOutput) -> None:
        metrics.MESSAGES_IN.labels(TIER, record.topic).inc()
        try:
            message = decode_scored(record.value)
            results = self.buffer.add(message, record.partition, record.offset, now, version)
        except (WireDecodeError, ConflictError) as exc:
            self.buffer.mark_seen(record.partition, record.offset)
            reason = exc.reason if isinstance(exc, WireDecodeError) else str(exc)
            out.dead_letters.append(dead_letter_for(record, TIER, reason, exc))
            metrics.DEAD_LETTERS.labels(TIER, type(exc).__name__).inc()
            return
        for result in results:
            if isinstance(result, CompleteGroup):
                self.pending.add(result, now)
            else:
                out.drops.append(result)

    def _moved_offsets(self) -> dict[int, int]:
        moved: dict[int, int] = {}
        for p in self.owned:
            marks = [m for m in (self.buffer.watermark(p), self.pending.low_offset(p)) if m is not None]
            if marks and min(marks) > self.committed.get(p, -1):
                moved[p] = min(marks)
        return moved

    async def _transact(self, out: CycleOutput, version: int, now: float) -> None:
        producer = self.txn.producer
        try:
            await producer.begin_transaction()
            futures = await self.emitter.send(out, version)
            await self.emitter.release_slots(out.drops)
            await asyncio.gather(*futures)
            await producer.commit_transaction()
        except ProducerFenced as exc:
            raise RuntimeError(
                f"grouping producer {self.txn.transactional_id!r} was fenced: another instance runs "
                "with the same grouping.instance_id (or this transaction timed out); exiting so that "
                "only one owner remains"
            ) from exc
        except KafkaError as exc:
            self.failures += 1
            if self.failures > MAX_TRANSACTION_FAILURES:
                raise RuntimeError(f"grouping: {self.failures} transactions in a row failed, last: {exc!r}") from exc
            log.warning("grouping transaction failed (%s: %s); aborting and rebuilding", type(exc).__name__, exc)
            await self.txn.replace()  # fencing aborts the failed transaction
            await self._rebuild()
            await asyncio.sleep(min(0.25 * 2**self.failures, 5.0))  # capped back-off before the retry
            return
        self.failures = 0
        self.committed.update(out.offsets)
        self._account(out, version, now)

    async def _rebuild(self) -> None:
        """After an aborted transaction: forget everything and re-read from the committed offsets."""
        partitions = set(self.owned)
        self._forget(partitions)
        await self._restore(partitions)
        await self._seek_to_committed(partitions)
        self.owned |= partitions

    async def _seek_to_committed(self, partitions: set[int]) -> None:
        """Position ``partitions`` at their committed offsets and bump ``generation``.

        Records polled before this (possibly from an earlier assignment, from offsets the
        rebuilt state knows nothing of) are discarded by the loop and fetched again.
        """
        tps = [TopicPartition(self.names.scored, p) for p in sorted(partitions)]
        starts = await self.consumer.beginning_offsets(tps) if tps else {}
        targets = {tp: await self.consumer.committed(tp) for tp in tps}
        for tp in tps:  # no await from here on: the seeks and the new generation go together
            offset = targets[tp]
            self.consumer.seek(tp, starts[tp] if offset is None else offset)
        self.generation += 1

    def _account(self, out: CycleOutput, version: int, now: float) -> None:
        for groups in out.batches:
            log.info("%s: emitted batch of %s (trainer version %d)", self.config.grouping.instance_id, [g.task_id for g in groups], version)
            for group in groups:
                head = group.head_version
                metrics.GROUPS.labels(TIER, "emitted").inc()
                metrics.GROUP_LATENCY.labels(TIER).observe(max(0.0, now - group.first_seen))
                metrics.STALENESS.labels(TIER).observe(version - head if head >= 0 else 0)
            metrics.MESSAGES_OUT.labels(TIER, self.names.batches).inc()
        for drop in out.drops:
            log.info("dropped group %s: %s (%s)", drop.task_id, drop.reason, drop.detail)
            metrics.GROUPS.labels(TIER, drop.reason).inc()
            metrics.MESSAGES_OUT.labels(TIER, self.names.batches).inc()


class _Listener(ConsumerRebalanceListener):
    def __init__(self, service: GroupingService) -> None:
        self._service = service

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._service.on_revoked({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._service.on_assigned({tp.partition for tp in assigned})


async def run(config: RollstreamConfig, stop: asyncio.Event) -> None:
    """Run one grouping instance until ``stop`` is set."""
    check_config(config)
    g = config.grouping
    names = TopicNames(config.experiment.experiment_name, config.experiment.trial_name)
    await ensure_topics(config.kafka, names)
    async with AsyncExitStack() as stack:
        redis = connect(config.redis)
        stack.push_async_callback(redis.aclose)
        client_id = f"{TIER}-{g.instance_id}"
        txn = TransactionalProducer(config.kafka, client_id, transactional_id(config, names))
        stack.push_async_callback(txn.stop)
        await txn.start()  # fences a dead predecessor before the changelog is read
        consumer = make_consumer(
            config.kafka, client_id, group_id=names.group_id(TIER), read_committed=True,
            session_timeout_ms=g.session_timeout_ms, heartbeat_interval_ms=max(100, g.session_timeout_ms // 4),
        )
        service = GroupingService(config, names, txn, consumer, redis)
        consumer.subscribe([names.scored], listener=_Listener(service))
        await consumer.start()
        stack.push_async_callback(consumer.stop)
        log.info("grouping instance %s consuming %s", g.instance_id, names.scored)
        await service.serve(stop)

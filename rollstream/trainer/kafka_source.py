"""The live source of steps: ``batches`` read in the trainer's consumer group.

One consumer (rank 0's, under ``torchrun``) reads ``batches`` with ``read_committed`` in the
consumer group ``trainer.group_id``, in the one :class:`~rollstream.kafka.partition_loop.PartitionLoop` with
the at-least-once delivery around a :class:`StepIntake`: taking a partition has nothing to
fence and seeks it to its committed offset; losing one forgets the groups read from it and
not handed out yet.

The loop runs as a background task for as long as the source is open, also while the trainer
computes a step (the source runs on its own thread in the synchronous API): fetching pauses
once ``trainer.prefetch_steps`` steps wait, and the poll goes on with paused partitions, so a
step of any length never exceeds ``max.poll.interval.ms`` and never costs the membership.

Commits: a step's ledger lines are written first, then its offsets are committed
(:meth:`AtLeastOnce.commit`, retried across a rebalance with the Kafka retry policy). At start the ledger
is reconciled with what Kafka has committed (see :mod:`rollstream.trainer.ledger`), and the
task ids of its last steps are never handed out again (the accumulator's second line of
defence, kept across restarts).

The consumption bound (``trainer.drop_stale``): before a step is handed out, the waiting train
groups more than ``staleness.max_head_offpolicyness`` versions behind the version the step
trains are dropped as ``stale`` (:meth:`StepAccumulator.drop_stale`). That version is the
newest one published when the step is handed out: the trainer's own word (``published``, e.g.
``VersionPublisher.last_published``) and what Redis answers, never less than the newest version
a group read was tagged with (a Redis that came back older answers less), never going back. The count of stale drops is cumulative and committed with every step as the
offsets' metadata (``rollstream.wire.messages.TrainerCommit``), then written to the staleness budget
in Redis, which returns their slots (a budget rebuilt from the topics reads it from Kafka:
:func:`~rollstream.kafka.trainer_commits.committed_stale_drops`, as this source does at start).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from aiokafka.structs import ConsumerRecord, TopicPartition
from redis.exceptions import RedisError

from rollstream.config import RollstreamConfig
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer, start_client, stop_client
from rollstream.kafka.partition_loop import AtLeastOnce, CommitRefused, Intake, PartitionLoop
from rollstream.kafka.topics import TopicNames
from rollstream.kafka.trainer_commits import committed_stale_drops
from rollstream.retry import KAFKA_RETRY
from rollstream.runtime.tasks import cancel_and_wait, wait_event
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys, connect
from rollstream.state.version_store import VersionStore
from rollstream.trainer.accumulator import StepAccumulator
from rollstream.trainer.ledger import LedgerEntry, StepLedger, check_ledger_group, reconcile
from rollstream.trainer.step_source import Step
from rollstream.wire import TrainerCommit, encode_trainer_commit

log = logging.getLogger(__name__)

VERSION_READ_SECONDS = 2.0


def ledger_path(config: RollstreamConfig) -> Path:
    """``trainer.ledger_path``, or ``<trainer.checkpoint_dir>/ledger.jsonl``."""
    tc = config.trainer
    return Path(tc.ledger_path) if tc.ledger_path else Path(tc.checkpoint_dir) / "ledger.jsonl"


class StepIntake(Intake):
    """The trainer source's side of its partition loop: groups into the accumulator until
    ``trainer.prefetch_steps`` steps wait; a lost partition's groups are forgotten (``committed``
    and ``tick``, inherited, do nothing)."""

    def __init__(self, accumulator: StepAccumulator, limit: int) -> None:
        self.accumulator = accumulator
        self._limit = limit  # groups waiting beyond the step in hand
        self.arrived = asyncio.Event()  # a step is ready
        self._room = asyncio.Event()  # a step was handed out
        self.assignments = 0  # partition sets taken (1 for a source that was never rebalanced)
        self.revocations = 0  # partition sets lost

    async def acquire(self, partitions: set[int]) -> None:
        self.assignments += 1

    def release(self, partitions: set[int]) -> None:
        self.revocations += 1
        self.accumulator.forget(partitions)

    def room(self) -> int:
        return max(0, self._limit - self.accumulator.waiting)

    async def wait_for_room(self, timeout: float) -> None:
        self._room.clear()
        if self.room() == 0:  # a step handed out before the clear made room already
            await wait_event(self._room, timeout)

    def handed_out(self) -> None:
        self._room.set()

    def take(self, records: dict[int, list[ConsumerRecord]]) -> None:
        for _, polled in sorted(records.items()):
            for record in polled:
                self.accumulator.take(record)
        if self.accumulator.ready():
            self.arrived.set()

    def committable(self, positions: dict[int, int]) -> dict[int, int]:
        return {}  # steps are committed when the trainer says so (KafkaStepSource.commit)


class KafkaStepSource:
    """Steps from ``batches`` in the trainer's consumer group (see the module docstring)."""

    def __init__(
        self, config: RollstreamConfig, *, include_eval: bool = False, client_id: str = "trainer",
        use_ledger: bool = True, published: Callable[[], int] | None = None,
    ) -> None:
        tc = config.trainer
        self._names = TopicNames.of(config)
        self.topic = self._names.batches
        self._kafka = config.kafka
        self.consumer_group = tc.group_id
        self._what = f"the trainer's consumer (consumer group {tc.group_id})"
        self.accumulator = StepAccumulator(
            config.staleness.groups_per_step, config.grouping.pad_value, include_eval, tc.remember_steps, topic=self.topic
        )
        # Without a ledger, nothing survives a restart but Kafka's committed offsets.
        self.ledger = StepLedger(ledger_path(config)) if use_ledger else None
        self._remember_steps = tc.remember_steps
        self._consumer = make_consumer(
            config.kafka, client_id, group_id=tc.group_id, read_committed=True,
            session_timeout_ms=tc.session_timeout_ms, heartbeat_interval_ms=tc.heartbeat_interval_ms,
            max_poll_interval_ms=tc.max_poll_interval_ms,
        )
        self.intake = StepIntake(self.accumulator, config.staleness.groups_per_step * tc.prefetch_steps)
        self._delivery = AtLeastOnce(self.intake, commit_interval=None,
                                     retry=KAFKA_RETRY.limited(max_attempts=tc.commit_retries), name="trainer")
        self.loop = PartitionLoop(consumer=self._consumer, topic=self.topic, delivery=self._delivery,
                                  poll_timeout_ms=tc.poll_timeout_ms, name="trainer")
        self.ownership = self.loop.ownership
        self.resumed_offsets: dict[int, int] = {}  # the offsets of the ledger's last step at start
        self._last_step = 0
        self._poll_seconds = tc.poll_timeout_ms / 1000
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._drop_stale = tc.drop_stale and config.staleness.enabled  # no staleness control: none here either
        self._eta = config.staleness.max_head_offpolicyness
        self._redis = connect(config.redis)
        keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
        self._versions = VersionStore(self._redis, keys)
        self._budget = StalenessBudget(self._redis, keys, self._eta, config.staleness.groups_per_step)
        self.published_version = 0  # the newest version known to be published (never goes back)
        self._published = published  # the trainer's own word for it (e.g. VersionPublisher.last_published)
        self.stale_committed = 0  # groups dropped as stale in committed steps, since the trial began

    @property
    def assignments(self) -> int:
        return self.intake.assignments

    @property
    def revocations(self) -> int:
        return self.intake.revocations

    exhausted = False  # the live source never ends

    # -- lifecycle --

    async def start(self) -> int:
        """Create missing topics, reconcile the ledger, join the consumer group and start polling;
        returns the last committed step."""
        # A trainer may start before any tier: create the trial's topics rather than wait on
        # a topic that does not exist yet.
        await ensure_topics(self._kafka, self._names)
        await start_client(self._consumer, self._kafka, self._what)
        try:
            self._last_step = await self._reconcile()
            self.stale_committed = await committed_stale_drops(self._kafka, self.consumer_group, self.topic,
                                                               f"trainer-stale-{self.consumer_group}")
            self.loop.subscribe()
        except BaseException:
            await stop_client(self._consumer, self._what)
            raise
        self._task = asyncio.create_task(self.loop.run(self._stop), name="trainer-poll")
        return self._last_step

    async def close(self) -> None:
        if self._task is not None:
            self._stop.set()  # the loop ends after its cycle (a step is committed by the trainer only)
            try:
                async with asyncio.timeout(self._poll_seconds + 10.0):
                    await asyncio.gather(self._task, return_exceptions=True)
            except TimeoutError:
                await cancel_and_wait(self._task)
        await stop_client(self._consumer, self._what)
        await self._redis.aclose()

    async def _reconcile(self) -> int:
        if self.ledger is None:
            return 0
        entries = self.ledger.read()
        check_ledger_group(entries, self.ledger.path, self.topic, self.consumer_group)
        partitions = sorted({p for e in entries for p in e.offsets})
        committed = {p: await self._consumer.committed(TopicPartition(self.topic, p)) for p in partitions}
        kept, _ = reconcile(self.ledger, committed)
        for entry in kept:  # where the job resumes, for the trainer's log
            self.resumed_offsets.update(entry.offsets)
        for entry in kept[-self._remember_steps:]:
            self.accumulator.remember(entry.task_ids)
        if kept:
            log.info("trainer ledger %s: resuming after step %d", self.ledger.path, kept[-1].step)
        return kept[-1].step if kept else 0

    # -- the steps --

    async def next_step(self, timeout: float | None) -> Step | None:
        """The next ``groups_per_step`` groups (see :class:`StepSource`)."""
        assert self._task is not None, "start() the source first"
        arrived = self.intake.arrived
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            self._check_poll()
            consume = await self._consume_version() if self._drop_stale else 0
            async with self.ownership.lock:
                if self._drop_stale:
                    self.accumulator.drop_stale(max(consume, self.accumulator.newest_tag), self._eta)
                if self.accumulator.ready():
                    self._last_step += 1
                    self.intake.handed_out()
                    return self.accumulator.next_step(self._last_step)
                arrived.clear()
            left = None if deadline is None else deadline - loop.time()
            if left is None:
                await arrived.wait()
            elif left <= 0 or not await wait_event(arrived, left):
                return None

    async def _consume_version(self) -> int:
        """The newest version published: the trainer's own word when it gives one, and what
        Redis says now (the last answer when it cannot), never less than an earlier answer."""
        if self._published is not None:
            self.published_version = max(self.published_version, self._published())
        try:
            version = await asyncio.wait_for(self._versions.get_version(), VERSION_READ_SECONDS)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            log.debug("cannot read the trainer version (%s); using %d", exc, self.published_version)
        else:
            self.published_version = max(self.published_version, version)
        return self.published_version

    def _check_poll(self) -> None:
        """Re-raise what stopped the background poll (a dead task is never ignored)."""
        self.ownership.raise_error()
        if self._task is not None and self._task.done():
            self._task.result()
            raise RuntimeError("the trainer's poll task ended unexpectedly")

    # -- commits --

    async def record(self, entries: list[LedgerEntry]) -> None:
        """Append ``entries`` to the ledger (durably): the first half of :meth:`commit`."""
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        for entry in entries:
            entry.restart, entry.topic, entry.group_id, entry.written_at = restart, self.topic, self.consumer_group, time.time()
        if self.ledger is not None:
            await asyncio.to_thread(self.ledger.append, entries)

    async def commit(self, entries: list[LedgerEntry]) -> None:
        """Write ``entries`` to the ledger, then commit the last one's offsets (retried across
        rebalances); :class:`CommitRefused` when every try failed."""
        if not entries:
            return
        await self.record(entries)
        # Offsets only move forward (commit skips the ones that did not move).
        step = entries[-1].step
        stale = self.stale_committed + sum(len(e.stale) for e in entries)
        metadata = encode_trainer_commit(TrainerCommit(step=step, stale_dropped=stale))
        try:
            await self._delivery.commit(entries[-1].offsets, what=f"committing trainer step {step}", metadata=metadata)
        except CommitRefused as exc:
            raise CommitRefused(
                f"step {step}: {exc}; another member of consumer group {self.consumer_group!r} may own these partitions: run "
                "one trainer job per trainer.group_id"
            ) from exc.__cause__
        if stale > self.stale_committed:
            self.stale_committed = stale
            await self._return_stale_slots()

    async def _return_stale_slots(self) -> None:
        """Tell the staleness budget how many groups were dropped as stale (their slots return);
        a Redis that cannot take it now gets it with the next step that drops one (and a budget
        rebuilt meanwhile reads it from Kafka)."""
        try:
            await asyncio.wait_for(self._budget.note_trainer_drops(self.stale_committed), VERSION_READ_SECONDS)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            log.warning("cannot return the staleness slots of %d stale groups yet (%s)", self.stale_committed, exc)

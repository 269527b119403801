"""The trainer-side client: training batches from ``batches``, weight versions to Redis.

    async with BatchConsumer(config) as batches, VersionPublisher(config) as versions:
        async for batch in batches:          # config.trainer.batch_size groups each
            step(batch.tensors)
            await batches.ack(batch)         # only now are its records committed
            await versions.publish(v, path)

Delivery: offsets are committed only by :meth:`BatchConsumer.ack`, so a trainer that dies
before acking gets the same groups again. Acks are cumulative (acking a batch also commits
every record read before it). Keep ``trainer.batch_size`` a multiple of
``grouping.groups_per_batch``: a record split across two steps can only be committed whole.
``dropped`` records are counted in ``drops_by_reason``; undecodable records are counted in
``undecodable`` and skipped with a warning, never raised; a group already handed out in a
recent step (re-delivered after a refused ack) is skipped and counted in
``duplicates_skipped``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from types import TracebackType

from aiokafka import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError
from aiokafka.structs import ConsumerRecord, TopicPartition

from consumers.training_batch import BatchAccumulator, TrainingBatch
from rollstream.api.engine import WeightUpdate
from rollstream.config import ConfigError, RollstreamConfig
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer
from rollstream.kafka.topics import TopicNames
from rollstream.redis_state import RedisKeys, VersionStore, connect

log = logging.getLogger(__name__)

__all__ = ["BatchConsumer", "TrainingBatch", "VersionPublisher"]


class BatchConsumer:
    """Async iterator of :class:`TrainingBatch` over ``batches`` (read_committed, manual commits).

    ``include_eval=False`` skips eval groups (counted in ``eval_skipped``); with True they are
    delivered and flagged per group in ``TrainingBatch.group_is_eval``. Batches with images get
    ``TrainingBatch.vision`` rebuilt by ``image_processor`` (default: the one of
    ``trainer.processor_path``, when set).
    """

    def __init__(
        self,
        config: RollstreamConfig,
        *,
        include_eval: bool = False,
        client_id: str = "trainer",
        poll_timeout_ms: int = 500,
        image_processor: object = None,
    ) -> None:
        if config.trainer.batch_size < 1:
            raise ConfigError("invalid configuration: trainer.batch_size must be >= 1")
        self.batch_size = config.trainer.batch_size
        if self.batch_size % config.grouping.groups_per_batch:
            log.warning(
                "trainer.batch_size %d is not a multiple of grouping.groups_per_batch %d: a record "
                "split across two steps is committed with the second, so a crash in between "
                "re-delivers the groups of the first step too",
                self.batch_size, config.grouping.groups_per_batch,
            )
        if image_processor is None and config.trainer.processor_path:
            from rollstream.vision.processor import load_image_processor

            image_processor = load_image_processor(config.trainer.processor_path)
        self.accumulator = BatchAccumulator(
            config.trainer.batch_size, config.grouping.pad_value, include_eval, image_processor=image_processor,
        )
        self._names = TopicNames(config.experiment.experiment_name, config.experiment.trial_name)
        self._kafka = config.kafka
        self._topic = self._names.batches
        self._poll_ms = poll_timeout_ms
        self._consumer = make_consumer(config.kafka, client_id, group_id=config.trainer.group_id, read_committed=True)
        self._fetched: deque[ConsumerRecord] = deque()
        self._generation = 0

    @property
    def drops_by_reason(self) -> Counter[str]:
        return self.accumulator.drops_by_reason

    @property
    def undecodable(self) -> int:
        return self.accumulator.undecodable

    @property
    def eval_skipped(self) -> int:
        return self.accumulator.eval_skipped

    @property
    def duplicates_skipped(self) -> int:
        """Groups skipped because this consumer already handed them out (see BatchAccumulator)."""
        return self.accumulator.duplicates_skipped

    async def start(self) -> None:
        # A trainer may start before any tier: create the trial's topics rather than wait
        # on a topic that does not exist yet.
        await ensure_topics(self._kafka, self._names)
        self._consumer.subscribe([self._topic], listener=_Reset(self))
        await self._consumer.start()

    async def close(self) -> None:
        await self._consumer.stop()

    async def __aenter__(self) -> BatchConsumer:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    def __aiter__(self) -> BatchConsumer:
        return self

    async def __anext__(self) -> TrainingBatch:
        batch = await self.next_batch()
        if batch is None:  # cannot happen without a timeout; keeps the type honest
            raise StopAsyncIteration
        return batch

    def reset(self) -> None:
        """Forget everything read but not handed out (on rebalance: positions go back to commits)."""
        self._fetched.clear()
        self.accumulator.reset()
        self._generation += 1

    async def next_batch(self, timeout: float | None = None) -> TrainingBatch | None:
        """The next ``batch_size`` groups, or None if they did not arrive within ``timeout`` s."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self.accumulator.ready():
            if self._fetched:
                self.accumulator.take(self._fetched.popleft())
                continue
            if deadline is not None and loop.time() >= deadline:
                return None
            fetched = await self._consumer.getmany(timeout_ms=self._poll_ms)
            # no await between the poll and this: a rebalance cannot slip in and make them stale
            self._fetched.extend(r for records in fetched.values() for r in records)
        batch = self.accumulator.hand_out()
        batch.generation = self._generation
        return batch

    async def ack(self, batch: TrainingBatch) -> bool:
        """Commit the records ``batch`` used (and all read before them). False if the commit
        was refused because a rebalance happened since: the new owner re-delivers them."""
        if batch.generation != self._generation:
            log.warning("not acking a batch read before a rebalance; its groups will be re-delivered")
            return False
        try:
            await self._consumer.commit(batch.offsets)
        except CommitFailedError as exc:
            log.warning("ack failed (%s); the batch's groups will be re-delivered", exc)
            return False
        return True


class _Reset(ConsumerRebalanceListener):
    def __init__(self, owner: BatchConsumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self._owner.reset()

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        pass


class VersionPublisher:
    """Publishes the trainer's weight versions to Redis (an async context manager)."""

    def __init__(self, config: RollstreamConfig) -> None:
        self._config = config
        self._redis = connect(config.redis)
        keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
        self._store = VersionStore(self._redis, keys)

    async def __aenter__(self) -> VersionPublisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._redis.aclose()

    async def publish(self, version: int, weights_path: str) -> None:
        """Make ``version`` (weights at ``weights_path``) current and announce it."""
        if version < 0:
            raise ValueError(f"weight version must be >= 0, got {version}")
        await self._store.publish(WeightUpdate(version, weights_path))

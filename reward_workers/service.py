"""The reward worker tier: ``episodes`` -> ``scored``, exactly once, in Kafka transactions.

Each poll batch (at most ``reward.max_batch`` records) is decoded, scored concurrently and
written to ``scored`` (keyed by task id) with its dead letters and its consumed offsets in
ONE transaction. Readers of ``scored`` use ``read_committed``, so a batch is seen entirely
or not at all, and a crash re-scores only uncommitted batches.

Worker identity: the transactional id is ``<group id>.<reward.worker_id>``. The default
worker id, ``<hostname>-<pid>``, changes on every restart; then a crashed worker's open
transaction stays open until ``kafka.transaction_timeout_ms`` expires, holding back
``read_committed`` readers of its partitions. Give each worker a STABLE ``reward.worker_id``
(e.g. the pod name of a StatefulSet) so that a restarted worker fences its dead
predecessor and aborts that transaction at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import (
    InvalidProducerEpoch,
    KafkaError,
    OutOfOrderSequenceNumber,
    ProducerFenced,
    TransactionalIdAuthorizationFailed,
    UnsupportedVersionError,
)

from reward_workers.batch import ScoredBatch, commit_batch, describe_outcomes, first_offsets, score_batch, task_id_of
from reward_workers.rebalance import BatchGuard
from reward_workers.scorer import Scorer
from rollstream.config import RollstreamConfig, raise_first_problem
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer, make_producer
from rollstream.kafka.topics import TopicNames

log = logging.getLogger(__name__)

# Errors after which this producer can never commit again (another worker took its
# transactional id, or the producer's state is unrecoverable).
FATAL_ERRORS = (
    ProducerFenced,
    InvalidProducerEpoch,
    OutOfOrderSequenceNumber,
    TransactionalIdAuthorizationFailed,
    UnsupportedVersionError,
)
RETRY_BACKOFF_SECONDS = 0.5  # doubled after each failure in a row, up to the cap
RETRY_BACKOFF_CAP_SECONDS = 10.0


class WorkerFencedError(RuntimeError):
    """Another reward worker now owns this worker's transactional id (or the producer is broken)."""


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def check_config(config: RollstreamConfig) -> None:
    rc = config.reward
    problems = [
        (rc.max_batch < 1, "reward.max_batch must be >= 1"),
        (rc.timeout_seconds <= 0, "reward.timeout_seconds must be > 0"),
        (rc.max_workers < 1, "reward.max_workers must be >= 1"),
        (rc.poll_timeout_ms < 1, "reward.poll_timeout_ms must be >= 1"),
        (rc.session_timeout_ms < 1000, "reward.session_timeout_ms must be >= 1000"),
        (rc.max_consecutive_failures < 1, "reward.max_consecutive_failures must be >= 1"),
    ]
    raise_first_problem(problems)


async def run(config: RollstreamConfig, stop: asyncio.Event) -> None:
    """Score episodes until ``stop`` is set; then finish the current batch, commit, and close."""
    check_config(config)
    worker_id = config.reward.worker_id or default_worker_id()
    names = TopicNames(config.experiment.experiment_name, config.experiment.trial_name)
    group_id = names.group_id("reward-worker")
    await ensure_topics(config.kafka, names)
    async with contextlib.AsyncExitStack() as stack:
        scorer = Scorer.from_config(config.reward, worker_id)
        stack.push_async_callback(scorer.aclose)
        producer = make_producer(
            config.kafka, f"reward-{worker_id}", transactional_id=f"{group_id}.{worker_id}"
        )
        await producer.start()  # fences a predecessor with the same worker id
        stack.push_async_callback(producer.stop)
        guard = BatchGuard()
        consumer = _make_consumer(config, names, group_id, worker_id, guard)
        await consumer.start()
        stack.push_async_callback(consumer.stop)
        log.info("reward worker %s consuming %s as group %s", worker_id, names.episodes, group_id)
        worker = _Worker(config, names, group_id, consumer, producer, scorer, guard)
        await worker.run(stop)
    log.info("reward worker %s stopped after %d batches", worker_id, worker.batches)


def _make_consumer(
    config: RollstreamConfig, names: TopicNames, group_id: str, worker_id: str, guard: BatchGuard
) -> AIOKafkaConsumer:
    session = config.reward.session_timeout_ms
    consumer = make_consumer(
        config.kafka, f"reward-{worker_id}", group_id=group_id, read_committed=True,
        max_poll_records=config.reward.max_batch,
        session_timeout_ms=session, heartbeat_interval_ms=max(100, session // 3),
    )
    consumer.subscribe([names.episodes], listener=guard)
    return consumer


class _Worker:
    """The poll-score-commit loop of one worker."""

    def __init__(
        self,
        config: RollstreamConfig,
        names: TopicNames,
        group_id: str,
        consumer: AIOKafkaConsumer,
        producer: AIOKafkaProducer,
        scorer: Scorer,
        guard: BatchGuard,
    ) -> None:
        self._rc = config.reward
        self._names = names
        self._group_id = group_id
        self._consumer = consumer
        self._producer = producer
        self._scorer = scorer
        self._guard = guard
        self._failures = 0
        self.batches = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            generation = self._guard.generation
            fetched = await self._consumer.getmany(
                timeout_ms=self._rc.poll_timeout_ms, max_records=self._rc.max_batch
            )
            if not any(fetched.values()):
                continue
            async with self._guard.lock:
                if self._guard.generation != generation:
                    log.info("a rebalance happened while fetching: batch dropped, re-read from committed offsets")
                    continue
                ok = await self._process(fetched)
            if not ok:
                await asyncio.sleep(self._backoff())

    async def _process(self, fetched: dict[TopicPartition, list]) -> bool:  # type: ignore[type-arg]
        """Score and commit one batch; False when it failed and was rewound for a retry."""
        try:
            batch = await score_batch(fetched, self._scorer)
            await commit_batch(self._producer, self._names, self._group_id, batch)
        except FATAL_ERRORS as exc:
            raise WorkerFencedError(
                f"reward worker cannot commit any more ({type(exc).__name__}): another worker with "
                f"the same reward.worker_id may have started; exiting so it can take over"
            ) from exc
        except (KafkaError, OSError, TimeoutError) as exc:
            # Retryable (broker unreachable, coordinator moved, request timed out): the
            # transaction is aborted, so nothing of this batch is visible; score it again.
            self._failures += 1
            if self._failures >= self._rc.max_consecutive_failures:
                log.error("%d batch transactions failed in a row: giving up", self._failures)
                raise
            log.warning(
                "batch transaction failed (%s: %s; %d in a row): aborted, rewinding to committed offsets",
                type(exc).__name__, exc, self._failures,
            )
            self._rewind(fetched)
            return False
        self._failures = 0
        self.batches += 1
        _log_batch(batch)
        return True

    def _backoff(self) -> float:
        return min(RETRY_BACKOFF_SECONDS * 2 ** (self._failures - 1), RETRY_BACKOFF_CAP_SECONDS)

    def _rewind(self, fetched: dict[TopicPartition, list]) -> None:  # type: ignore[type-arg]
        """Seek each partition of a failed batch back to its committed offset (see ``first_offsets``)."""
        assigned = self._consumer.assignment()
        for tp, offset in first_offsets(fetched).items():
            if tp in assigned:
                self._consumer.seek(tp, offset)


def _log_batch(batch: ScoredBatch) -> None:
    tasks = sorted({task_id_of(r) for r in batch.results})
    shown = ", ".join(tasks[:5]) + (f" (+{len(tasks) - 5} more)" if len(tasks) > 5 else "")
    log.info(
        "committed %d records: %s; %d dead letters; tasks %s",
        batch.records, describe_outcomes(batch.results), len(batch.dead_letters), shown or "-",
    )

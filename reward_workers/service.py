"""The reward worker tier: ``episodes`` -> ``scored``, exactly once, in Kafka transactions.

The tier is the one partition loop (:mod:`rollstream.kafka.partition_loop`) with the
exactly-once delivery (:mod:`rollstream.kafka.consume_transform_produce`) around
:class:`RewardTransform`: each poll
batch (at most ``reward.max_batch`` records) is scored concurrently, and each input
partition's scored messages, dead letters and consumed offset are committed in ONE
transaction under that partition's own transactional id (``<group id>.p<partition>``).
Readers of ``scored`` use ``read_committed``, so a batch is seen entirely or not at all, and a
crash re-scores only uncommitted records.

Fencing: whoever is assigned partition p registers p's transactional id before reading p's
committed offset, which fences every earlier owner, also a paused or partitioned instance
that still believes it owns p (docs/GUARANTEES.md, "Fencing"). ``reward.worker_id`` names the
worker in logs and client ids; any number of workers may run, with any ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

from rollstream.reward_workers.reward_function import Scorer
from rollstream.reward_workers.transform import TIER, RewardTransform
from rollstream.config import RollstreamConfig
from rollstream.runtime.health import mark_ready
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer, start_client, stop_client
from rollstream.kafka.consume_transform_produce import ExactlyOnce
from rollstream.kafka.partition_loop import PartitionLoop
from rollstream.kafka.topics import TopicNames
from rollstream.kafka.transactions import PartitionProducers
from rollstream.retry import transaction_retry

log = logging.getLogger(__name__)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


async def run(config: RollstreamConfig, stop: asyncio.Event) -> None:
    """Score episodes until ``stop`` is set; then finish the current batch, commit, and close."""
    rc = config.reward
    worker_id = rc.worker_id or default_worker_id()
    names = TopicNames.of(config)
    group_id = names.group_id(TIER)
    await ensure_topics(config.kafka, names)
    async with contextlib.AsyncExitStack() as stack:
        scorer = Scorer.from_config(rc, worker_id)
        stack.push_async_callback(scorer.aclose)
        client_id = f"reward-{worker_id}"
        producers = PartitionProducers(config.kafka, client_id, base_id=group_id)
        stack.push_async_callback(producers.close)
        consumer = make_consumer(
            config.kafka, client_id, group_id=group_id, read_committed=True, max_poll_records=rc.max_batch,
            session_timeout_ms=rc.session_timeout_ms, heartbeat_interval_ms=max(100, rc.session_timeout_ms // 3),
        )
        transform = RewardTransform(names, scorer)
        delivery = ExactlyOnce(
            group_id=group_id, producers=producers, transform=transform, dead_letter_topic=names.dead_letter,
            max_record_bytes=config.kafka.max_message_bytes,
            retry=transaction_retry(rc.max_consecutive_failures, config.kafka.outage_patience_seconds),
            name=f"reward worker {worker_id}",
        )
        loop = PartitionLoop(
            consumer=consumer, topic=names.episodes, delivery=delivery, poll_timeout_ms=rc.poll_timeout_ms,
            max_records=rc.max_batch, name=f"reward worker {worker_id}",
            lost_partition_hold_seconds=2 * rc.session_timeout_ms / 1000,
        )
        loop.subscribe()
        await start_client(consumer, config.kafka, f"the consumer of reward worker {worker_id}")
        stack.push_async_callback(stop_client, consumer, "the consumer of the reward worker")
        log.info("reward worker %s consuming %s as group %s", worker_id, names.episodes, group_id)
        mark_ready()
        await loop.run(stop)
    log.info("reward worker %s stopped after committing %d scored messages", worker_id, transform.scored)

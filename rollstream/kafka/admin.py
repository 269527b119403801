"""Create the topics of one trial with the right partition counts and settings."""

from __future__ import annotations

import asyncio
import logging

from aiokafka.admin import NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError, TopicAlreadyExistsError

from rollstream.config import KafkaConfig
from rollstream.kafka.clients import authentication_refusal, make_admin
from rollstream.kafka.topics import TopicNames
from rollstream.retry import RetryPolicy

log = logging.getLogger(__name__)

BROKER_WAIT_SECONDS = 300.0  # how long a starting tier waits for an unreachable broker


def transient(exc: BaseException) -> bool:
    """A broker that is down, restarting or electing a controller: worth waiting for."""
    if isinstance(exc, (KafkaTimeoutError, asyncio.TimeoutError)):
        return True
    return isinstance(exc, KafkaError) and bool(getattr(exc, "retriable", False))


async def ensure_topics(config: KafkaConfig, names: TopicNames, wait_seconds: float = BROKER_WAIT_SECONDS) -> None:
    """Create every topic of the trial that does not exist yet (idempotent, race-safe).

    All data topics share ``config.partitions`` so that keys (task ids) land in the same
    partition number everywhere; the grouping changelog is co-partitioned with ``scored``.

    Every tier calls this first, so it also waits for the broker: while the broker cannot be
    reached (down, restarting) it retries with capped backoff, logging each try, for up to
    ``wait_seconds``; then the last error is raised. A tier started during a broker restart
    therefore comes up with the broker instead of crash-looping. A broker that refuses the
    configured credentials or TLS settings raises ``KafkaAuthenticationError`` at once.
    """
    attempts = 0

    async def once() -> None:
        nonlocal attempts
        attempts += 1
        try:
            await _ensure_once(config, names)
        except KafkaConnectionError as exc:
            refusal = await authentication_refusal(config)
            if refusal is not None:
                raise refusal from exc
            raise

    policy = RetryPolicy(initial=0.5, maximum=5.0)
    try:
        await asyncio.wait_for(
            policy.call(once, retry_on=transient, what=f"reaching kafka at {config.bootstrap_servers}"),
            wait_seconds,
        )
    except asyncio.TimeoutError:
        raise KafkaTimeoutError(
            f"kafka at {config.bootstrap_servers} not reachable after {wait_seconds:.0f}s ({attempts} tries)"
        ) from None


async def _ensure_once(config: KafkaConfig, names: TopicNames) -> None:
    admin = make_admin(config)
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        wanted = [
            _new_topic(config, name, compacted=False) for name in names.data_topics()
        ] + [_new_topic(config, name, compacted=True) for name in names.compacted_topics()]
        missing = [topic for topic in wanted if topic.name not in existing]
        if missing:
            await _create(admin, missing)
    finally:
        await admin.close()


def _new_topic(config: KafkaConfig, name: str, *, compacted: bool) -> NewTopic:
    topic_configs = {"max.message.bytes": str(config.max_message_bytes)}
    if compacted:
        topic_configs.update({"cleanup.policy": "compact", "segment.ms": "60000"})
    return NewTopic(
        name=name,
        num_partitions=config.partitions,
        replication_factor=config.replication_factor,
        topic_configs=topic_configs,
    )


async def _create(admin, topics: list[NewTopic]) -> None:  # type: ignore[no-untyped-def]
    try:
        response = await admin.create_topics(topics)
    except TopicAlreadyExistsError:
        return
    for name, code, *_ in getattr(response, "topic_errors", []):
        if code not in (0, TopicAlreadyExistsError.errno):
            raise RuntimeError(f"could not create topic {name}: error code {code}")
    log.info("created topics %s", ", ".join(t.name for t in topics))

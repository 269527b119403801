"""Create the topics of one trial with the right partition counts and settings."""

from __future__ import annotations

import logging

from aiokafka.admin import NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from rollstream.config import KafkaConfig
from rollstream.kafka.clients import make_admin
from rollstream.kafka.topics import TopicNames

log = logging.getLogger(__name__)


async def ensure_topics(config: KafkaConfig, names: TopicNames) -> None:
    """Create every topic of the trial that does not exist yet (idempotent, race-safe).

    All data topics share ``config.partitions`` so that keys (task ids) land in the same
    partition number everywhere; the grouping changelog is co-partitioned with ``scored``.
    """
    admin = make_admin(config)
    await admin.start()
    try:
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

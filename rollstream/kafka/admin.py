"""Create the topics of one trial with the right partition counts and settings, and check the
ones that exist (``rollstream.kafka.topic_check``) before a tier uses them."""

from __future__ import annotations

import logging
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from rollstream.config import KafkaConfig
from rollstream.kafka.clients import make_admin, start_client, stop_client, wait_out_outage
from rollstream.kafka.topic_check import (
    CHECKED_CONFIGS,
    TopicLayoutError,
    TopicState,
    check_layout,
    min_insync_replicas,
)
from rollstream.kafka.topics import TopicNames

log = logging.getLogger(__name__)


class NotEnoughBrokers(KafkaError):
    """Fewer brokers are up than the replication factor of the topics to create (a cluster
    still starting, or a replication factor too high for it): retriable, so a starting tier
    waits for the brokers as it waits for an unreachable cluster."""

    retriable = True


async def ensure_topics(config: KafkaConfig, names: TopicNames, wait_seconds: float | None = None) -> None:
    """Create every topic of the trial that does not exist yet (idempotent, race-safe), then
    check the ones that existed (``rollstream.kafka.topic_check``).

    All data topics but ``prompts`` share ``config.partitions`` so that keys (task ids) land in
    the same partition number everywhere; the grouping changelog is co-partitioned with
    ``scored``; ``prompts`` gets ``config.prompt_partitions`` (default the same).
    New topics get ``config.replication_factor`` replicas and ``min.insync.replicas`` from
    :func:`~rollstream.kafka.topic_check.min_insync_replicas`. Existing topics that break the
    pipeline (co-partitioned topics with different partition counts, a changelog that is not
    compacted, ...) raise :class:`TopicLayoutError` naming what differs and how to fix it, so
    a tier stops before it consumes anything; what only weakens durability is logged as a
    warning.

    Every tier calls this first, so it also waits for the broker: while the broker cannot be
    reached (down, restarting), or topics must be created and fewer brokers are up than their
    replication factor, it retries as :func:`~rollstream.kafka.clients.wait_out_outage` does,
    for ``wait_seconds`` (default ``config.outage_patience_seconds``); then
    ``KafkaTimeoutError`` names the last error. A tier started during a broker restart
    therefore comes up with the broker instead of crash-looping. A broker that refuses the
    configured credentials or TLS settings raises ``KafkaAuthenticationError`` at once.
    """
    await wait_out_outage(config, lambda: _ensure_once(config, names), "creating the trial's topics", wait_seconds)


async def _ensure_once(config: KafkaConfig, names: TopicNames) -> None:
    admin = make_admin(config)
    try:
        await admin.start()
        brokers = len((await admin.describe_cluster())["brokers"])  # registered and unfenced
        existing = set(await admin.list_topics())
        wanted = [
            _new_topic(config, name, names, compacted=False) for name in names.data_topics()
        ] + [_new_topic(config, name, names, compacted=True) for name in names.compacted_topics()]
        missing = [topic for topic in wanted if topic.name not in existing]
        if missing:
            if brokers < config.replication_factor:
                raise NotEnoughBrokers(
                    f"kafka.replication_factor={config.replication_factor} needs {config.replication_factor} "
                    f"brokers to create {len(missing)} topic(s), {brokers} up; waiting for more "
                    "(or set kafka.replication_factor to at most the number of brokers)"
                )
            await _create(admin, missing)
        # topics created just now are as asked (their metadata may not have spread yet); the
        # others are described, and all are checked together (co-partitioning spans both)
        states = await describe_topics(admin, [t.name for t in wanted if t.name in existing])
        states.update({t.name: TopicState(t.name, t.num_partitions, t.replication_factor, dict(t.topic_configs))
                       for t in missing})
    finally:
        await stop_client(admin, "an admin client")
    findings = check_layout(config, names, states, brokers)
    for warning in findings.warnings:
        log.warning("topic check: %s", warning)
    if findings.errors:
        raise TopicLayoutError("the trial's topics cannot be used:\n- " + "\n- ".join(findings.errors))


async def describe_topics(admin: AIOKafkaAdminClient, topics: list[str]) -> dict[str, TopicState]:
    """Partition count, smallest replica count and the checked configs of each existing topic
    in ``topics`` (a topic that does not exist is left out)."""
    if not topics:
        return {}
    described = await admin.describe_topics(topics)
    resources = [ConfigResource(ConfigResourceType.TOPIC, name, configs=dict.fromkeys(CHECKED_CONFIGS)) for name in topics]
    configs = _config_values(await admin.describe_configs(resources))
    states = {}
    for entry in described:
        partitions = entry["partitions"]
        if entry["error_code"] != 0 or not partitions:
            continue
        name = entry["topic"]
        replication = min(len(p["replicas"]) for p in partitions)
        states[name] = TopicState(name, len(partitions), replication, configs.get(name, {}))
    return states


def _config_values(responses: list[Any]) -> dict[str, dict[str, str]]:
    values: dict[str, dict[str, str]] = {}
    for response in responses:
        for resource in response.to_object()["resources"]:
            if resource["error_code"] == 0:
                values[resource["resource_name"]] = {
                    e["config_names"]: e["config_value"] for e in resource["config_entries"] if e["config_value"] is not None
                }
    return values


def _new_topic(config: KafkaConfig, name: str, names: TopicNames, *, compacted: bool) -> NewTopic:
    topic_configs = {
        "max.message.bytes": str(config.max_message_bytes),
        "min.insync.replicas": str(min_insync_replicas(config)),
    }
    if compacted:
        topic_configs.update({"cleanup.policy": "compact", "segment.ms": "60000"})
    return NewTopic(
        name=name,
        num_partitions=config.partitions_of(names.role_of(name) or ""),
        replication_factor=config.replication_factor,
        topic_configs=topic_configs,
    )


async def _create(admin: AIOKafkaAdminClient, topics: list[NewTopic]) -> None:
    try:
        response = await admin.create_topics(topics)
    except TopicAlreadyExistsError:
        return
    for name, code, *_ in getattr(response, "topic_errors", []):
        if code not in (0, TopicAlreadyExistsError.errno):
            raise RuntimeError(f"could not create topic {name}: error code {code}")
    log.info("created topics %s", ", ".join(t.name for t in topics))


async def topic_partitions(config: KafkaConfig, topic: str) -> list[int] | None:
    """The sorted partition numbers of ``topic``; None when it does not exist.

    Asks the admin API: a consumer only knows the partitions of topics it already follows,
    and the topic list is checked first so that no metadata request can auto-create it.
    """
    admin = make_admin(config, "topic-partitions")
    await start_client(admin, config, "an admin client")
    try:
        if topic not in set(await admin.list_topics()):
            return None
        for entry in await admin.describe_topics([topic]):
            if entry["topic"] == topic and entry["error_code"] == 0:
                return sorted(part["partition"] for part in entry["partitions"])
        return None
    finally:
        await stop_client(admin, "an admin client")

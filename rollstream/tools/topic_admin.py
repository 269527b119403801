"""``rollstream topics create``: create the trial's topics, and grow the ones that may grow.

Partitions can only be added. ``prompts`` grows to ``kafka.prompt_partitions`` at any time,
also while the pipeline runs: nothing downstream depends on where a prompt lies, and the
rollout workers' rebalance re-runs nothing (their prompt claims). Every other data topic and
the grouping changelog grow together (``plan_growth``), and only while the trial is drained:
a task's records are routed by ``hash(task id) % partitions``, so records in flight before the
growth would no longer meet the ones after it. A trial whose tiers still have uncommitted
input is refused with the lag per tier. Replication and topic configs are not changed here (Kafka moves replicas with
``kafka-reassign-partitions.sh``); the check at the end names what differs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from aiokafka.admin import AIOKafkaAdminClient, NewPartitions

from rollstream.config import RollstreamConfig
from rollstream.kafka.admin import describe_topics, ensure_topics
from rollstream.kafka.clients import make_admin
from rollstream.kafka.scan import scan_topic
from rollstream.kafka.topic_check import TopicLayoutError, growable, plan_growth, prompts_growth
from rollstream.kafka.topics import TopicNames
from rollstream.tools.status import consumer_groups

log = logging.getLogger(__name__)

TIER_INPUTS = ("rollout-worker", "reward-worker", "grouping")  # whose lag must be 0 to grow


@dataclass
class TopicsReport:
    """What ``create_topics`` did: the topics, and those grown (name -> (from, to))."""

    topics: list[str]
    grown: dict[str, tuple[int, int]] = field(default_factory=dict)


async def create_topics(config: RollstreamConfig) -> TopicsReport:
    """Grow what must grow (refusing what may not), create what is missing, check the rest.

    Raises :class:`TopicLayoutError` with what differs and how to fix it."""
    names = TopicNames.of(config)
    admin = make_admin(config.kafka, "topics")
    await admin.start()
    try:
        states = await describe_topics(admin, [names.prompts, *growable(names)])
        growth = plan_growth(config.kafka.partitions, names, states)
        prompts_from = prompts_growth(config.kafka, names, states)
        if growth:  # refused as a whole: nothing grows unless everything asked for may
            await _refuse_unless_drained(config, names, admin)
        if prompts_from is not None:
            wanted = config.kafka.partitions_of("prompts")
            await admin.create_partitions({names.prompts: NewPartitions(wanted)})
            log.info("grew %s to %d partitions (live: the rollout workers rebalance, re-running nothing)",
                     names.prompts, wanted)
        if growth:
            await admin.create_partitions({name: NewPartitions(config.kafka.partitions) for name in growth})
            log.info("grew %s to %d partitions", ", ".join(growth), config.kafka.partitions)
    finally:
        await admin.close()
    await ensure_topics(config.kafka, names)
    grown = {name: (n, config.kafka.partitions) for name, n in growth.items()}
    if prompts_from is not None:
        grown[names.prompts] = (prompts_from, config.kafka.partitions_of("prompts"))
    return TopicsReport(topics=[*names.data_topics(), *names.compacted_topics()], grown=grown)


async def _refuse_unless_drained(config: RollstreamConfig, names: TopicNames, admin: AIOKafkaAdminClient) -> None:
    lags = await input_lags(config, names, admin)
    busy = {tier: lag for tier, lag in lags.items() if lag}
    if busy:
        listed = ", ".join(f"{tier} {lag}" for tier, lag in busy.items())
        raise TopicLayoutError(
            f"the trial is not drained (records not yet committed by: {listed}); growing partitions now "
            "would split the groups in flight. Stop the producer, wait until `rollstream status` shows "
            "lag 0 for every tier, then run this again (or grow in a new trial)"
        )


async def input_lags(config: RollstreamConfig, names: TopicNames, admin: AIOKafkaAdminClient,
                     timeout: float = 30.0) -> dict[str, int]:
    """Per tier of ``TIER_INPUTS``: records of its input topic (as ``read_committed`` readers
    see them) after the offsets its group committed; all of them when it committed nothing.

    Records are counted by reading them (the one bounded read, each within ``timeout``), not by
    subtracting offsets: transaction markers take offsets too, and a group commits the offset
    after its last record, before the marker."""
    lags: dict[str, int] = {}
    for group in consumer_groups(config, names):
        if group.tier not in TIER_INPUTS or group.topic is None:
            continue
        committed = await admin.list_consumer_group_offsets(group.group_id)
        start = {tp.partition: meta.offset for tp, meta in committed.items()
                 if tp.topic == group.topic and meta is not None and meta.offset >= 0}
        lags[group.tier] = 0
        async for _ in scan_topic(config.kafka, group.topic, "topics-lag", start=start, timeout=timeout):
            lags[group.tier] += 1
    return lags

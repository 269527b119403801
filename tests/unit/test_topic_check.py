"""The topic check: what breaks the pipeline (an error naming what differs and the fix), what
only weakens it (a warning), and which topics ``rollstream topics create`` may grow."""

from __future__ import annotations

import pytest

from rollstream.config import ConfigError, KafkaConfig, config_from_dict
from rollstream.kafka.topic_check import (
    TopicLayoutError,
    TopicState,
    check_layout,
    min_insync_replicas,
    plan_growth,
    prompts_growth,
)
from rollstream.kafka.topics import TopicNames

NAMES = TopicNames("exp", "t0")
DURABLE = {"cleanup.policy": "delete", "max.message.bytes": str(16 * 1024 * 1024), "min.insync.replicas": "2",
           "unclean.leader.election.enable": "false"}


def healthy(partitions: int = 4, replication: int = 3) -> dict[str, TopicState]:
    topics = {n: TopicState(n, partitions, replication, dict(DURABLE)) for n in NAMES.data_topics()}
    for n in NAMES.compacted_topics():
        topics[n] = TopicState(n, partitions, replication, {**DURABLE, "cleanup.policy": "compact"})
    return topics


def replace(topics: dict[str, TopicState], name: str, **changes: object) -> dict[str, TopicState]:
    old = topics[name]
    configs = {**old.configs, **changes.pop("configs", {})}  # type: ignore[dict-item]
    topics[name] = TopicState(name, int(changes.get("partitions", old.partitions)),  # type: ignore[arg-type]
                              int(changes.get("replication", old.replication)), configs)  # type: ignore[arg-type]
    return topics


CLUSTER = KafkaConfig(partitions=4, replication_factor=3)


def test_a_healthy_replicated_trial_has_nothing_to_report() -> None:
    found = check_layout(CLUSTER, NAMES, healthy(), brokers=3)
    assert found.errors == [] and found.warnings == []


def test_scored_with_other_partitions_is_an_error_naming_both_counts_and_the_fix() -> None:
    found = check_layout(CLUSTER, NAMES, replace(healthy(), NAMES.scored, partitions=6), brokers=3)
    assert len(found.errors) == 1
    error = found.errors[0]
    assert f"{NAMES.scored} has 6" in error and f"{NAMES.episodes} has 4" in error
    assert f"{NAMES.grouping_changelog} has 4" in error
    assert "rollstream topics create --set kafka.partitions=6" in error and "trial_name" in error


def test_prompts_with_fewer_partitions_than_asked_is_a_warning_that_names_the_live_fix() -> None:
    found = check_layout(CLUSTER, NAMES, replace(healthy(), NAMES.prompts, partitions=2), brokers=3)
    assert found.errors == []
    assert [w for w in found.warnings if "prompts has 2 partitions, fewer than 4" in w and "while the pipeline runs" in w]
    more = KafkaConfig(replication_factor=3, prompt_partitions=16)
    assert check_layout(more, NAMES, replace(healthy(), NAMES.prompts, partitions=16), brokers=3).warnings == []


def test_prompts_grow_on_their_own_to_prompt_partitions() -> None:
    topics = healthy(partitions=4)
    assert prompts_growth(KafkaConfig(prompt_partitions=12), NAMES, topics) == 4
    assert prompts_growth(KafkaConfig(), NAMES, topics) is None  # default: kafka.partitions
    with pytest.raises(TopicLayoutError, match="partitions can only grow"):
        prompts_growth(KafkaConfig(prompt_partitions=2), NAMES, topics)


@pytest.mark.parametrize("topic", ["grouping_changelog", "producer_cursor"])
def test_a_compacted_topic_that_is_not_compacted_is_an_error(topic: str) -> None:
    name = getattr(NAMES, topic)
    found = check_layout(CLUSTER, NAMES, replace(healthy(), name, configs={"cleanup.policy": "delete"}), brokers=3)
    assert len(found.errors) == 1 and name in found.errors[0] and "cleanup.policy=compact" in found.errors[0]


def test_a_compacted_data_topic_is_an_error() -> None:
    found = check_layout(CLUSTER, NAMES, replace(healthy(), NAMES.episodes, configs={"cleanup.policy": "compact,delete"}),
                         brokers=3)
    assert len(found.errors) == 1 and "must not be compacted" in found.errors[0]


def test_min_isr_above_replication_is_an_error() -> None:
    found = check_layout(CLUSTER, NAMES, replace(healthy(), NAMES.batches, replication=1), brokers=3)
    assert any("min.insync.replicas=2 but only 1 replica" in e for e in found.errors)
    assert any("replication 1, below kafka.replication_factor=3" in w for w in found.warnings)


def test_weak_durability_is_warned_about() -> None:
    topics = replace(healthy(), NAMES.scored, configs={"min.insync.replicas": "1", "unclean.leader.election.enable": "true",
                                                         "max.message.bytes": "1048588"})
    found = check_layout(CLUSTER, NAMES, topics, brokers=3)
    assert found.errors == []
    text = "\n".join(found.warnings)
    assert "min.insync.replicas=1 with 3 replicas" in text
    assert "unclean.leader.election.enable=true" in text
    assert "max.message.bytes=1048588, below kafka.max_message_bytes=16777216" in text


def test_replication_one_on_a_three_broker_cluster_is_warned_about_but_not_on_one_broker() -> None:
    single = KafkaConfig(partitions=4)
    topics = {n: TopicState(n, 4, 1, {**s.configs, "min.insync.replicas": "1"}) for n, s in healthy().items()}
    assert check_layout(single, NAMES, topics, brokers=1).warnings == []
    warned = check_layout(single, NAMES, topics, brokers=3).warnings
    assert any("kafka.replication_factor=1 on a cluster of 3 brokers" in w for w in warned)


def test_min_insync_replicas_defaults_to_one_less_than_replication() -> None:
    assert [min_insync_replicas(KafkaConfig(replication_factor=r)) for r in (1, 2, 3, 5)] == [1, 1, 2, 4]
    assert min_insync_replicas(KafkaConfig(replication_factor=3, min_insync_replicas=3)) == 3
    with pytest.raises(ConfigError, match="kafka.min_insync_replicas"):
        config_from_dict({"kafka": {"replication_factor": 3, "min_insync_replicas": 4}})


def test_growth_takes_every_data_topic_but_prompts_and_the_changelog_but_not_the_cursor() -> None:
    grow = plan_growth(8, NAMES, healthy(partitions=4))
    assert set(grow) == {*NAMES.data_topics(), NAMES.grouping_changelog} - {NAMES.prompts}
    assert set(grow.values()) == {4}
    assert plan_growth(4, NAMES, healthy(partitions=4)) == {}


def test_growth_mends_a_trial_whose_copartitioned_topics_differ() -> None:
    grow = plan_growth(6, NAMES, replace(healthy(), NAMES.scored, partitions=6))
    assert NAMES.scored not in grow and grow[NAMES.episodes] == 4


def test_shrinking_is_refused_with_the_fix() -> None:
    with pytest.raises(TopicLayoutError, match=r"kafka.partitions=2 is below .* partitions can only grow.*Set kafka.partitions to 4"):
        plan_growth(2, NAMES, healthy(partitions=4))

"""Each rollout worker's consumer remembers its own sticky assignment (rollstream.kafka.assignors)."""

from __future__ import annotations

from aiokafka.coordinator.assignors.sticky.sticky_assignor import StickyPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment

from rollstream.kafka.assignors import rollout_assignors, sticky_assignor

TOPIC = "rs.x.t0.prompts"


def _assigned(partitions: list[int]) -> ConsumerProtocolMemberAssignment:
    return ConsumerProtocolMemberAssignment(0, [(TOPIC, partitions)], b"")


def test_a_consumers_previous_assignment_is_its_own() -> None:
    """Two consumers of one process: what the group assigned to the first is not what the second
    tells the leader it had (aiokafka's class keeps one assignment per process)."""
    first, second = sticky_assignor(), sticky_assignor()
    first.on_assignment(_assigned([0, 2]))
    second.on_assignment(_assigned([1, 3]))
    assert first.member_assignment is not None and {tp.partition for tp in first.member_assignment} == {0, 2}
    assert {tp.partition for tp in second.member_assignment} == {1, 3}
    assert first.metadata([TOPIC]).user_data != second.metadata([TOPIC]).user_data
    fresh = sticky_assignor()
    assert fresh.member_assignment is None and fresh.metadata([TOPIC]).user_data == b""  # claims nothing
    assert StickyPartitionAssignor.member_assignment is None  # aiokafka's class is left alone


def test_a_rollout_consumer_names_one_strategy_sticky() -> None:
    """One strategy: aiokafka sends a JoinGroup per strategy, and the extra ones rebalance the
    group again (tests/integration/test_rollout_group.py shows it on the broker)."""
    strategies = rollout_assignors()
    assert [s.name for s in strategies] == ["sticky"]
    assert strategies[0] is not rollout_assignors()[0]

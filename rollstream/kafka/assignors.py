"""Partition assignors with state of their own.

aiokafka's ``StickyPartitionAssignor`` keeps what it needs between rebalances (this member's
last assignment and generation, sent to the group leader with every join) on the CLASS: every
consumer of a process that names it shares one "previous assignment". Two rollout workers in
one process (tests, an embedding application) then each claim the other's partitions; the
leader warns "assigned to multiple consumers following sticky assignment generation -1" and
the group can rebalance over and over instead of settling, and a consumer started after
another one's assignment claims partitions of a topic it never read. :func:`sticky_assignor`
gives each consumer a subclass of its own, so the state is per consumer as Kafka's protocol
means it; the protocol name (``sticky``) is the same, so members agree with any other
sticky member of the group.

A consumer names ONE strategy (:func:`rollout_assignors`): aiokafka 0.14 sends one JoinGroup
per strategy it is given, one after the other, each with one more protocol than the last
(aio-libs/aiokafka#1168). The second one changes the member's protocols after the round
completed, so the group rebalances again; with several members doing it, each member's late
JoinGroup restarts the round the others just finished and the group can rebalance for minutes
(three rollout workers of one process, two worker processes of the chaos run).
"""

from __future__ import annotations

import itertools

from aiokafka.coordinator.assignors.sticky.sticky_assignor import StickyPartitionAssignor

_count = itertools.count()


def sticky_assignor() -> type[StickyPartitionAssignor]:
    """A sticky assignor class whose remembered assignment belongs to one consumer."""
    return type(f"StickyPartitionAssignor{next(_count)}", (StickyPartitionAssignor,),
                {"member_assignment": None, "generation": StickyPartitionAssignor.DEFAULT_GENERATION_ID})


def rollout_assignors() -> tuple[type, ...]:
    """The rollout worker's strategy, for one consumer: sticky alone (a rebalance leaves
    partitions where they are when it can; one strategy, see the module docstring)."""
    return (sticky_assignor(),)

"""The grouping tier's ``SlotReleaser`` against a real Redis: the commits of two partitions
release their drops at once (the transactional loop gathers them), and every slot comes back
exactly once without either call failing."""

from __future__ import annotations

import asyncio

import pytest

from rollstream.consumers.grouping.emission import SlotReleaser
from rollstream.consumers.grouping.groups import DroppedGroup
from rollstream.state.budget import RebuiltCounts, StalenessBudget
from rollstream.state.client import RedisKeys

pytestmark = pytest.mark.broker


def drop(task_id: str, partition: int) -> DroppedGroup:
    return DroppedGroup(task_id, "timeout", "", False, 4, partition, 0, 0, 0.0)


async def test_two_partitions_releasing_at_once_return_each_slot_once(redis_client, unique_name: str) -> None:
    budget = StalenessBudget(redis_client, RedisKeys(unique_name, "t0"), 0, 8)
    tasks = [f"p:0:{i}" for i in range(6)]
    await budget.restore(RebuiltCounts(tasks))
    releaser = SlotReleaser(budget)
    await asyncio.gather(releaser.release([drop(t, 0) for t in tasks[:3]]),
                         releaser.release([drop(t, 1) for t in tasks[3:]]))
    assert releaser.unreleased == {}
    assert (await budget.usage())["dropped"] == 6

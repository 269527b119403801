"""SlotReleaser: staleness slots of committed drops, released once, also when partitions commit
concurrently (the shared loop commits every partition's transaction at the same time)."""

from __future__ import annotations

import asyncio
from collections import Counter

from rollstream.consumers.grouping.emission import SlotReleaser
from rollstream.consumers.grouping.groups import DroppedGroup


class SlowBudget:
    """The two budget methods SlotReleaser calls; each release takes a moment, as over a network."""

    def __init__(self) -> None:
        self.released: Counter[str] = Counter()
        self.notified = 0

    async def release(self, task_id: str, reason: str) -> bool:
        await asyncio.sleep(0.01)
        self.released[task_id] += 1
        return True

    async def notify(self) -> None:
        self.notified += 1


def drop(task: str, partition: int, is_eval: bool = False) -> DroppedGroup:
    return DroppedGroup(task, "all_rejected", "", is_eval, 4, partition, 0, 0, 0.0)


async def test_concurrent_releases_release_each_slot_once_and_skip_eval_groups() -> None:
    budget = SlowBudget()
    releaser = SlotReleaser(budget)  # type: ignore[arg-type]
    await asyncio.gather(
        releaser.release([drop("a", 0), drop("e", 0, is_eval=True)]),
        releaser.release([drop("b", 1)]),
        releaser.release([drop("c", 1)]),
    )
    assert budget.released == {"a": 1, "b": 1, "c": 1} and not releaser.unreleased

"""The watch on the staleness bound: :class:`BudgetWatch` samples the staleness counters in
Redis while a block runs and keeps the worst ``admitted - dropped - capacity`` it saw (the bound
holds while it is at most 0)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from harness.waits import stop_task
from rollstream.config import RollstreamConfig
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys, connect


@dataclass
class BudgetWatch:
    """Samples the staleness counters every ``interval`` seconds; ``worst`` is the largest
    ``admitted - dropped - capacity`` seen (the bound held while it is <= 0)."""

    config: RollstreamConfig
    interval: float = 0.2
    samples: int = 0
    worst: int | None = None
    worst_sample: dict[str, int] = field(default_factory=dict)
    unreadable: int = 0
    _task: asyncio.Task[None] | None = None

    @property
    def exceeded(self) -> bool:
        """True once a sample held more in flight than the capacity allowed."""
        return self.worst is not None and self.worst > 0

    async def __aenter__(self) -> BudgetWatch:
        self._task = asyncio.create_task(self._watch(), name="budget-watch")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            await stop_task(self._task, "the watcher of the staleness budget")

    async def _watch(self) -> None:
        exp, staleness = self.config.experiment, self.config.staleness
        redis = connect(self.config.redis)
        budget = StalenessBudget(redis, RedisKeys(exp.experiment_name, exp.trial_name),
                                 staleness.max_head_offpolicyness, staleness.groups_per_step)
        try:
            while True:
                try:
                    usage = await budget.usage()  # one script: a consistent snapshot
                except (RedisError, OSError):
                    self.unreadable += 1
                else:
                    self.samples += 1
                    over = usage["in_use"] - usage["capacity"]
                    if self.worst is None or over > self.worst:
                        self.worst, self.worst_sample = over, usage
                await asyncio.sleep(self.interval)
        finally:
            await redis.aclose()

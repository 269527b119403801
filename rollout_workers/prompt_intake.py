"""How a rollout worker takes prompt records: the intake of its at-least-once partition loop.

The worker runs the one :class:`~rollstream.kafka.partition_loop.PartitionLoop` with the
:class:`~rollstream.kafka.partition_loop.AtLeastOnce` delivery around a :class:`PromptIntake`:

- room: prompt records are taken while fewer than ``rollout.max_concurrent_rollouts`` samples
  are in flight (the loop pauses the partitions otherwise, and keeps polling);
- take: each record goes to the :class:`~rollstream.rollout_workers.runner.PromptRunner`
  (offset tracked at once, then claimed and run; ``rollout_workers/claims.py``);
- committable: per partition, the lowest offset whose prompt has not published every sample
  (``OffsetTracker``), or the consumer's position when nothing is pending (past transaction
  markers);
- release: before a partition moves, what is done of it is committed (by the delivery), then
  its offsets and the prompts other workers hold on it are forgotten; prompts still running
  here go on, and their claims tell the next owner to wait for them;
- tick: re-raise the first failure of any background task, and ask again about the prompts
  other workers hold.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka.structs import ConsumerRecord, TopicPartition

from rollstream.rollout_workers.offsets import OffsetTracker
from rollstream.rollout_workers.runner import PromptRunner

log = logging.getLogger(__name__)

RECHECK_SECONDS = 1.0  # how often prompts held by other workers are asked about again


class PromptIntake:
    """The rollout worker's side of its partition loop (module docstring)."""

    def __init__(self, runner: PromptRunner, tracker: OffsetTracker, topic: str, max_concurrent_rollouts: int,
                 follower: asyncio.Task[None]) -> None:
        self._runner = runner
        self._tracker = tracker
        self._topic = topic
        self._limit = max_concurrent_rollouts
        self._follower = follower
        self._owned: set[int] = set()
        self._next_recheck = time.monotonic() + RECHECK_SECONDS

    def _tps(self, partitions: set[int]) -> set[TopicPartition]:
        return {TopicPartition(self._topic, p) for p in partitions}

    async def acquire(self, partitions: set[int]) -> None:
        self._owned |= partitions

    def release(self, partitions: set[int]) -> None:
        revoked = self._tps(partitions)
        unfinished = sum(self._tracker.in_flight(tp) for tp in revoked)
        self._tracker.forget(revoked)
        self._runner.forget(revoked)
        self._owned -= partitions
        log.info("partitions revoked: %s of %s (%d prompts not finished: whoever reads them next waits for "
                 "their claims)", sorted(partitions), self._topic, unfinished)

    def room(self) -> int:
        # A record holds group_size samples; taking at most ``room`` records keeps the backlog
        # (work a crash would redo) small.
        return max(0, self._limit - self._runner.inflight_samples - self._runner.claiming)

    async def wait_for_room(self, timeout: float) -> None:
        await self._runner.wait_for_room(timeout, lambda: self.room() > 0)

    def take(self, records: dict[int, list[ConsumerRecord]]) -> None:
        for _, batch in sorted(records.items()):
            for record in batch:
                self._runner.take(record)

    def committable(self, positions: dict[int, int]) -> dict[int, int]:
        for partition, position in positions.items():
            self._tracker.advance(TopicPartition(self._topic, partition), position)
        return {tp.partition: offset for tp, offset in self._tracker.committable().items() if tp.topic == self._topic}

    async def tick(self) -> None:
        self._runner.tasks.raise_if_failed()
        if self._follower.done():
            self._follower.result()  # re-raises its error
            raise RuntimeError("the version follower ended unexpectedly")
        if self._runner.held and time.monotonic() >= self._next_recheck:
            await self._runner.recheck_held(self._tps(self._owned))
            self._next_recheck = time.monotonic() + RECHECK_SECONDS

"""How a rollout worker takes prompt records: the intake of its at-least-once partition loop.

The worker runs the one :class:`~rollstream.kafka.partition_loop.PartitionLoop` with the
:class:`~rollstream.kafka.partition_loop.AtLeastOnce` delivery around a :class:`PromptIntake`:

- room: prompt records are taken while fewer than twice ``rollout.max_concurrent_rollouts``
  samples are in flight: as many generate, and up to as many more wait for a slot, so that a
  slot that frees is filled at once and not after the next poll and claim (a group that ends
  all at once left the server idle for that long); the loop pauses the partitions otherwise,
  and keeps polling;
- acquire: each partition's fresh frontier, its last stable offset now
  (``rollout_workers/local_claims.py``: records from there on were never fetched by anyone);
- take: each record goes to the :class:`~rollstream.rollout_workers.runner.PromptRunner`
  (offset tracked at once, then resolved and run; ``rollout_workers/claims.py``);
- committable: per partition, the lowest offset whose prompt has not published every sample
  (``OffsetTracker``), or the consumer's position when nothing is pending (past transaction
  markers);
- committed: the claims of the records a commit passed are deleted;
- release: before a partition moves, what is done of it is committed (by the delivery), then
  its offsets and the prompts other workers hold on it are forgotten; prompts still running
  here go on, and their claims tell the next partition owner to wait for them;
- tick: re-raise the first failure of any background task (the version follower and the
  claims' upkeep included), and ask again about the prompts other workers hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition

from rollstream.rollout_workers.offsets import OffsetTracker
from rollstream.rollout_workers.runner import PromptRunner

log = logging.getLogger(__name__)

RECHECK_SECONDS = 1.0  # how often prompts held by other workers are asked about again
QUEUED_ROUNDS = 2  # samples in flight, in rounds of max_concurrent_rollouts: one generating, one waiting
EndOffsets = Callable[[list[TopicPartition]], Awaitable[dict[TopicPartition, int]]]


class PromptIntake:
    """The rollout worker's side of its partition loop (module docstring)."""

    def __init__(self, runner: PromptRunner, tracker: OffsetTracker, topic: str, max_concurrent_rollouts: int,
                 watched: dict[str, asyncio.Task[None]], end_offsets: EndOffsets) -> None:
        self._runner = runner
        self._tracker = tracker
        self._topic = topic
        self._limit = max_concurrent_rollouts
        self._watched = watched  # background tasks that must never end: name -> task
        self._end_offsets = end_offsets  # the consumer's (read_committed: last stable offsets)
        self._owned: set[int] = set()
        self._next_recheck = time.monotonic() + RECHECK_SECONDS

    def _tps(self, partitions: set[int]) -> set[TopicPartition]:
        return {TopicPartition(self._topic, p) for p in partitions}

    async def acquire(self, partitions: set[int]) -> None:
        tps = sorted(self._tps(partitions))
        try:
            frontier: dict[TopicPartition, int] = await self._end_offsets(tps)
        except (KafkaError, OSError, asyncio.TimeoutError) as exc:  # nothing counts as fresh then
            log.warning("cannot read the last stable offsets of %s (%s): no record of them runs without "
                        "a claim", sorted(partitions), exc)
            frontier = {}
        for tp in tps:
            self._runner.local.taken(tp, frontier.get(tp))
        self._owned |= partitions

    def release(self, partitions: set[int]) -> None:
        revoked = self._tps(partitions)
        unfinished = sum(self._tracker.in_flight(tp) for tp in revoked)
        self._tracker.forget(revoked)
        self._runner.forget(revoked)
        for tp in revoked:
            self._runner.local.lost(tp)
        self._owned -= partitions
        log.info("partitions revoked: %s of %s (%d prompts not finished: whoever reads them next waits for "
                 "their claims)", sorted(partitions), self._topic, unfinished)

    def room(self) -> int:
        # A record holds group_size samples; taking at most ``room`` records keeps the backlog
        # (work a crash would redo) to one round of waiting samples.
        # (records waiting for Redis to vouch for them count too: each may run here next)
        return max(0, QUEUED_ROUNDS * self._limit - self._runner.inflight_samples - self._runner.claiming
                   - len(self._runner.unsure))

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

    def committed(self, offsets: dict[int, int]) -> None:
        for partition, offset in offsets.items():
            passed = self._runner.local.committed(TopicPartition(self._topic, partition), offset)
            if passed:
                self._runner.claims.forget(partition, passed)

    async def tick(self) -> None:
        self._runner.tasks.raise_if_failed()
        for name, task in self._watched.items():
            if task.done():
                task.result()  # re-raises its error
                raise RuntimeError(f"{name} ended unexpectedly")
        if self._runner.held and time.monotonic() >= self._next_recheck:
            await self._runner.recheck_held(self._tps(self._owned))
            self._next_recheck = time.monotonic() + RECHECK_SECONDS

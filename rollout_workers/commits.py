"""Commit the tracker's committable offsets: periodically, on revocation and at shutdown.

The prompts consumer's rebalance guard is the shared :class:`PartitionOwnership`
(:func:`prompt_ownership`), whose release commits what is done.

Only partitions the consumer still owns are committed, and only offsets that moved since
the last successful commit. A failed commit (e.g. the group is rebalancing) is logged and
retried at the next commit point; committing late only means re-running a few prompts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import IllegalStateError, KafkaError
from aiokafka.structs import TopicPartition

from rollstream.rollout_workers.offsets import OffsetTracker
from rollstream.kafka.ownership import PartitionOwnership

log = logging.getLogger(__name__)

POSITION_TIMEOUT_SECONDS = 5.0


class OffsetCommitter:
    """Commits ``tracker.committable()`` for owned partitions through ``consumer``."""

    def __init__(self, consumer: AIOKafkaConsumer, tracker: OffsetTracker) -> None:
        self._consumer = consumer
        self._tracker = tracker
        self._committed: dict[TopicPartition, int] = {}

    async def advance_positions(self) -> None:
        """Let idle partitions commit up to the consumer position (past transaction markers).

        Call only from the loop that hands every fetched record to the tracker, between fetches.
        """
        for tp in self._consumer.assignment():
            try:
                position = await asyncio.wait_for(self._consumer.position(tp), POSITION_TIMEOUT_SECONDS)
            except (IllegalStateError, asyncio.TimeoutError, KafkaError):
                continue  # revoked meanwhile, or not known yet: nothing to advance
            self._tracker.advance(tp, position)

    async def commit(self, only: Iterable[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Commit what may be committed (restricted to ``only``); returns what was committed."""
        owned = self._consumer.assignment()
        wanted = set(only) if only is not None else owned
        offsets = {
            tp: offset
            for tp, offset in self._tracker.committable().items()
            if tp in owned and tp in wanted and self._committed.get(tp) != offset
        }
        if not offsets:
            return {}
        try:
            await self._consumer.commit(offsets)
        except (KafkaError, IllegalStateError) as exc:
            log.warning("offset commit failed (%s: %s); will retry", type(exc).__name__, exc)
            return {}
        self._committed.update(offsets)
        log.debug("committed %s", {f"{tp.topic}[{tp.partition}]": o for tp, o in offsets.items()})
        return offsets

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        for tp in tps:
            self._committed.pop(tp, None)


def prompt_ownership(consumer: AIOKafkaConsumer, topic: str, committer: OffsetCommitter,
                     tracker: OffsetTracker, forget: Callable[[set[TopicPartition]], None],
                     name: str) -> PartitionOwnership:
    """The rebalance guard of the prompts consumer (the shared one, see
    :mod:`rollstream.kafka.ownership`): nothing to fence on taking a partition; before a
    partition moves, what is done is committed and the rest forgotten (``forget``: the
    runner's prompts held by other workers).

    Prompts of revoked partitions that are still running here go on and publish their
    samples; their claims tell the partition's next owner (maybe this worker again) not to run
    them again but to wait for them (``rollout_workers/claims.py``).
    """

    async def acquire(partitions: set[int]) -> set[int]:
        return partitions

    async def release(partitions: set[int]) -> None:
        revoked = {TopicPartition(topic, p) for p in partitions}
        committed = await committer.commit(only=revoked)
        unfinished = sum(tracker.in_flight(tp) for tp in revoked)
        tracker.forget(revoked)
        committer.forget(revoked)
        forget(revoked)
        log.info(
            "partitions revoked: %s (committed %s; %d prompts not finished: the next owner waits for their claims)",
            _names(revoked), {f"{tp.topic}[{tp.partition}]": o for tp, o in committed.items()}, unfinished,
        )

    return PartitionOwnership(consumer, topic, acquire, release, name)


def _names(tps: Iterable[TopicPartition]) -> str:
    return ", ".join(sorted(f"{tp.topic}[{tp.partition}]" for tp in tps)) or "none"

"""What the grouping tier does with ``scored`` records: :class:`GroupingTransform`, its part of
the exactly-once loop (:mod:`rollstream.kafka.consume_transform_produce`).

Each cycle feeds the polled ``scored`` records into a
:class:`~rollstream.consumers.grouping.groups.GroupBuffer`, then, per input partition, writes
what ended (emitted and dropped groups, changelog outcomes, tombstones, dead letters) with the
new input offset, all in one transaction. The committed input offset of a partition never
passes the first record of a group that has not been emitted, so after a crash, rebalance or
failed transaction the partition is rebuilt by re-reading from it, skipping the groups whose
outcome is in the changelog. Every complete group becomes its own ``batches`` record in the
cycle it completes, so nothing complete waits in memory.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from aiokafka.structs import ConsumerRecord

from rollstream.consumers.grouping.changelog import read_outcomes, version_floor
from rollstream.consumers.grouping.emission import QueuedGroup, Emission, SlotReleaser
from rollstream.consumers.grouping.filters import load_group_filters
from rollstream.consumers.grouping.groups import CompleteGroup, DroppedGroup, GroupBuffer, GroupFilters, GroupResult
from rollstream.consumers.grouping.trainer_version import TrainerVersion, VersionReading
from rollstream.consumers.grouping.version_check import EpisodeRefused, above_trainer, version_problem
from rollstream.runtime import metrics
from rollstream.config import RollstreamConfig
from rollstream.kafka.consume_transform_produce import PartitionOutput
from rollstream.kafka.topics import TopicNames
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys
from rollstream.state.version_store import VersionStore
from rollstream.trajectory.staleness import staleness
from rollstream.wire import Episode, SampleRejected, ScoredEpisode, TaskFailed, WireDecodeError, decode_scored

log = logging.getLogger(__name__)

TIER = "grouping"


class GroupingTransform:
    """The grouping state of the owned partitions and what each cycle does with it."""

    tier = TIER
    concurrent = False  # a partition's records feed its groups in offset order

    def __init__(self, config: RollstreamConfig, names: TopicNames, redis: Any) -> None:
        g = config.grouping
        self.config, self.names = config, names
        eta = config.staleness.max_head_offpolicyness if g.drop_stale else None
        filters = GroupFilters(group_filters=load_group_filters(g), max_head_offpolicyness=eta)
        self.buffer = GroupBuffer(g.group_timeout_seconds, g.dedupe_window_seconds, filters)
        keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
        self.version = TrainerVersion(VersionStore(redis, keys))
        budget = StalenessBudget(redis, keys, config.staleness.max_head_offpolicyness, config.staleness.groups_per_step)
        self.releaser = SlotReleaser(budget)
        self.emission = Emission(names, g.pad_value)
        self.committed_offsets: dict[int, int] = {}  # partition -> input offset committed by this instance
        self._now = 0.0
        self._reading = VersionReading(0, known=False)  # the trainer version of this cycle
        self._complete: dict[int, list[CompleteGroup]] = {}  # completed this cycle, per partition
        self._dropped: dict[int, list[DroppedGroup]] = {}  # ended this cycle, per partition
        self._emitted: dict[int, tuple[list[QueuedGroup], list[DroppedGroup]]] = {}

    # -- partitions --

    async def acquire(self, partitions: set[int]) -> None:
        outcomes = await read_outcomes(self.config.kafka, self.names.grouping_changelog, partitions)
        loaded = self.buffer.outcomes.restore(outcomes, time.monotonic(), time.time())
        self.version.raise_floor(version_floor(outcomes))  # never below what these partitions were tagged
        log.info("restored %d group outcomes of partitions %s", loaded, sorted(partitions))

    def release(self, partitions: set[int]) -> None:
        self.buffer.revoke(partitions)
        for p in partitions:
            self.committed_offsets.pop(p, None)
            self._complete.pop(p, None)
            self._dropped.pop(p, None)
        metrics.OPEN_GROUPS.labels(TIER).set(self.buffer.open_count())

    # -- one cycle --

    async def begin(self, records: dict[int, list[ConsumerRecord]]) -> None:
        self._now = time.monotonic()
        if records or self.buffer.open_count():
            self._reading = await self.version.get()
        for drop in self.buffer.expire(self._now):
            self._dropped.setdefault(drop.partition, []).append(drop)

    async def transform(self, record: ConsumerRecord, out: PartitionOutput) -> None:
        self.buffer.mark_seen(record.partition, record.offset)  # the watermark passes it, whatever happens
        message = decode_scored(record.value)
        if isinstance(message, ScoredEpisode):
            await self._check_versions(message.episode)
        self._route(self.buffer.add(message, record.partition, record.offset, self._now, self._reading.version))

    async def _check_versions(self, episode: Episode) -> None:
        """Raise :class:`EpisodeRefused` when ``episode``'s versions cannot be true (see
        :mod:`rollstream.consumers.grouping.version_check`); Redis is asked again only for
        tokens newer than this cycle's reading."""
        problem = version_problem(episode)
        if problem is None and episode.tail_version > self._reading.version:
            fresh = await self.version.get()
            if fresh.known and fresh.published:
                problem = above_trainer(episode, fresh.version)
        if problem is not None:
            raise EpisodeRefused(episode, problem)

    def on_error(self, record: ConsumerRecord, error: Exception, out: PartitionOutput) -> None:
        """An undecodable record with a key ends its task's group at once (``task_failed``)
        instead of leaving it to time out; a record that contradicts its group (another
        ``group_size``) is only dead-lettered, and the group goes on with its other samples; an
        episode whose versions were refused counts as a failed sample of its group."""
        if isinstance(error, EpisodeRefused):
            episode = error.episode
            refused = SampleRejected(task_id=episode.task_id, sample_idx=episode.sample_idx,
                                     group_size=episode.group_size, is_eval=episode.is_eval,
                                     reason=f"versions refused: {error}", failed=True)
            self._route(self.buffer.add(refused, record.partition, record.offset, self._now, self._reading.version))
            return
        if not isinstance(error, WireDecodeError) or record.key is None:
            return
        failure = TaskFailed(task_id=record.key.decode("utf-8", "replace"), reason=f"undecodable scored record: {error}")
        self._route(self.buffer.add(failure, record.partition, record.offset, self._now, self._reading.version))

    async def finish(self, partition: int, out: PartitionOutput, final: bool) -> None:
        reading = self._reading
        ready = self._complete.pop(partition, [])
        drops = self._dropped.pop(partition, [])
        emitted, refused = self.emission.emit(ready, reading, out)  # refused: queued as drops already
        for drop in drops:
            self.emission.drop(drop, reading.version, out)
        drops += refused
        committed = self.committed_offsets.get(partition)
        if committed is not None:
            for task_id, p in self.buffer.outcomes.expired(self._now, {partition: committed}):
                self.emission.tombstone(task_id, p, out)
        out.offset = self._next_offset(partition)
        self._emitted[partition] = (emitted, drops)
        metrics.OPEN_GROUPS.labels(TIER).set(self.buffer.open_count())

    async def committed(self, partition: int, out: PartitionOutput) -> None:
        if out.offset is not None:
            self.committed_offsets[partition] = out.offset
        queued, drops = self._emitted.pop(partition, ([], []))
        self._account(queued, drops)
        await self.releaser.release(drops)

    # -- helpers --

    def _route(self, results: list[GroupResult]) -> None:
        for result in results:
            if isinstance(result, CompleteGroup):
                self._complete.setdefault(result.partition, []).append(result)
            else:
                self._dropped.setdefault(result.partition, []).append(result)

    def _next_offset(self, partition: int) -> int | None:
        """The input offset to commit: below every open group; None if unchanged."""
        mark = self.buffer.watermark(partition)
        if mark is not None and mark > self.committed_offsets.get(partition, -1):
            return mark
        return None

    def _account(self, queued: list[QueuedGroup], drops: list[DroppedGroup]) -> None:
        now = self._now
        for emitted in queued:
            group, version = emitted.group, emitted.trainer_version
            known = "" if emitted.version_known else ", not read from Redis at emission"
            log.info("%s: emitted group %s (trainer version %d%s)", self.config.grouping.instance_id,
                     group.task_id, version, known, extra={"task_id": group.task_id, "trainer_version": version})
            metrics.GROUPS.labels(TIER, "emitted").inc()
            metrics.GROUP_LATENCY.labels(TIER).observe(max(0.0, now - group.first_seen))
            metrics.STALENESS.labels(TIER).observe(staleness(version, group.head_version))
        for drop in drops:
            log.info("dropped group %s: %s (%s)", drop.task_id, drop.reason, drop.detail,
                     extra={"task_id": drop.task_id, "drop_reason": drop.reason})
            metrics.GROUPS.labels(TIER, drop.reason).inc()

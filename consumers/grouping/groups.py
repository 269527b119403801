"""Gathering the samples of each prompt group: pure logic, no I/O.

:class:`GroupBuffer` takes decoded ``scored`` messages with their partition and offset and
returns what ended: a :class:`CompleteGroup` (its accepted episodes, ready to be emitted) or a
:class:`DroppedGroup` with a reason. It also answers the offset that is safe to commit per
partition (:meth:`GroupBuffer.watermark`): below it, every group has ended.

Rules (what callers may rely on):

- a message of a task whose outcome is known (:class:`~rollstream.consumers.grouping.outcomes.OutcomeLog`) is
  ignored: a late duplicate from a re-run prompt, or input re-read after a crash;
- a second message for the same ``(task_id, sample_idx)`` is ignored;
- a message whose ``group_size`` differs from its open group's raises :class:`ConflictError`
  and leaves the group unchanged (the caller dead-letters the record);
- ``TaskFailed`` drops the group at once ("task_failed");
- once ``group_size`` samples arrived with none accepted: every one rejected by the workflow ->
  "all_rejected"; at least one failed -> "all_failed" (the detail counts both and quotes the
  first failure by sample index). A failure is never counted as a rejection;
- otherwise the filters run (train groups only; eval groups are never filtered): the group
  filters of ``grouping.group_filters`` in order (``rollstream.consumers.grouping.filters``; the
  first that refuses it -> "filtered"), then the oldest generated token more than
  ``max_head_offpolicyness`` versions behind the trainer version its record will carry ->
  "stale"; a group that passes keeps its counts of rejected and failed samples;
- :meth:`GroupBuffer.expire` drops groups open longer than the timeout ("timeout"). The clock
  restarts when a group is rebuilt after a crash (its first sample is re-read then).
- images (vision): an episode names the images its rows show and carries the bytes of those
  its run of the prompt had not sent yet; the group keeps the bytes of every episode message
  of its task, duplicates included (a re-run prompt's first carrier may be a duplicate of a
  sample already in), and is complete only once it holds every image its accepted episodes
  show; ``CompleteGroup.images`` has exactly those.

Memory holds the open groups and the outcome log (bounded by its window), nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from rollstream.consumers.grouping.outcomes import OutcomeLog
from rollstream.trajectory.staleness import Versions, group_trainer_version, head_and_tail, staleness
from rollstream.wire import Episode, SampleRejected, ScoredEpisode, TaskFailed
from rollstream.wire.messages import DropReason

Sample = ScoredEpisode | SampleRejected
ScoredInput = ScoredEpisode | SampleRejected | TaskFailed


class ConflictError(ValueError):
    """A message that contradicts its open group (different ``group_size``)."""


@dataclass(frozen=True)
class GroupFilters:
    """Optional drops of complete train groups: ``group_filters`` in order (each returns ``None``
    to keep the group or the detail of its drop; ``rollstream.consumers.grouping.filters`` builds
    them from the config), then staleness (``max_head_offpolicyness=None``: no staleness check)."""

    group_filters: tuple[GroupFilter, ...] = ()
    max_head_offpolicyness: int | None = None


@dataclass
class OpenGroup:
    """A group still waiting for samples; offsets are of its records in ``partition``."""

    task_id: str
    group_size: int
    is_eval: bool
    first_seen: float
    partition: int
    min_offset: int
    max_offset: int
    samples: dict[int, Sample] = field(default_factory=dict)
    images: dict[str, bytes] = field(default_factory=dict)  # by digest, from any of its messages

    def missing_images(self) -> set[str]:
        """Digests the accepted samples show whose bytes have not arrived."""
        shown = {d for s in self.samples.values() if isinstance(s, ScoredEpisode)
                 for row in s.episode.row_images for d in row}
        return shown - set(self.images)


@dataclass(frozen=True)
class CompleteGroup:
    """A group with every sample in: the accepted episodes sorted by ``sample_idx``;
    ``rejected`` / ``failed`` count the samples the workflow rejected / that failed."""

    task_id: str
    group_size: int
    is_eval: bool
    episodes: tuple[ScoredEpisode, ...]
    rejected: int
    partition: int
    min_offset: int
    max_offset: int
    first_seen: float
    failed: int = 0
    images: dict[str, bytes] = field(default_factory=dict)  # every image its episodes show, by digest

    @property
    def versions(self) -> Versions:
        """Oldest and newest version over the group's generated tokens (-1: none): its
        episodes' spans combined (``rollstream.trajectory.staleness``)."""
        return head_and_tail(e.episode for e in self.episodes)

    @property
    def head_version(self) -> int:
        return self.versions.head_version


@dataclass(frozen=True)
class DroppedGroup:
    """A group that ended without training data, and why."""

    task_id: str
    reason: DropReason
    detail: str
    is_eval: bool
    group_size: int
    partition: int
    min_offset: int
    max_offset: int
    first_seen: float


GroupResult = CompleteGroup | DroppedGroup
GroupFilter = Callable[[CompleteGroup], "str | None"]  # None keeps the group; a string is why it is dropped


def drop_of(group: OpenGroup | CompleteGroup, reason: DropReason, detail: str) -> DroppedGroup:
    return DroppedGroup(
        group.task_id, reason, detail, group.is_eval, group.group_size,
        group.partition, group.min_offset, group.max_offset, group.first_seen,
    )


def _no_accepted(group: OpenGroup, rejected: int, failures: list[SampleRejected]) -> DroppedGroup:
    """The drop of a group none of whose samples was accepted: rejected or failed."""
    if not failures:
        return drop_of(group, "all_rejected", f"all {rejected} samples rejected by the workflow")
    first = failures[0]
    detail = (
        f"{len(failures)} of {len(group.samples)} samples failed, {rejected} rejected; "
        f"first failure (sample {first.sample_idx}): {first.reason}"
    )
    return drop_of(group, "all_failed", detail)


def apply_filters(group: CompleteGroup, filters: GroupFilters, trainer_version: int) -> GroupResult:
    """``group`` itself, or its drop when a filter removes it (eval groups pass unfiltered).

    Staleness is judged against the trainer version the group's record will carry
    (``group_trainer_version``: ``trainer_version``, or the group's newest token's when
    newer), so a group that passes is never emitted staler than the bound."""
    if group.is_eval:
        return group
    for refuse in filters.group_filters:
        detail = refuse(group)
        if detail is not None:
            return drop_of(group, "filtered", detail)
    eta = filters.max_head_offpolicyness
    head, tail = group.versions
    version = group_trainer_version(trainer_version, tail)  # what its record will be tagged with
    lag = staleness(version, head)
    if eta is not None and lag > eta:
        detail = f"head version {head} is {lag} behind trainer version {version} (max {eta})"
        return drop_of(group, "stale", detail)
    return group


class GroupBuffer:
    """Open groups of any number of partitions, and the outcome log of the groups that ended."""

    def __init__(
        self,
        group_timeout_seconds: float,
        dedupe_window_seconds: float,
        filters: GroupFilters | None = None,
    ) -> None:
        if group_timeout_seconds <= 0:
            raise ValueError("grouping.group_timeout_seconds must be > 0")
        self.group_timeout_seconds = group_timeout_seconds
        self.filters = filters or GroupFilters()
        self.outcomes = OutcomeLog(dedupe_window_seconds)
        self._open: dict[int, dict[str, OpenGroup]] = {}
        self._next_offset: dict[int, int] = {}  # highest offset seen + 1, per partition

    def open_count(self) -> int:
        return sum(len(groups) for groups in self._open.values())

    def open_groups(self, partition: int) -> list[OpenGroup]:
        return list(self._open.get(partition, {}).values())

    def mark_seen(self, partition: int, offset: int) -> None:
        """Account for a record at ``offset`` (also undecodable ones, so the watermark passes them)."""
        if offset + 1 > self._next_offset.get(partition, -1):
            self._next_offset[partition] = offset + 1

    def watermark(self, partition: int) -> int | None:
        """The offset to commit: the lowest first offset of an open group, else highest seen + 1.

        None when no record of ``partition`` was seen since it was assigned.
        """
        groups = self._open.get(partition)
        if groups:
            return min(g.min_offset for g in groups.values())
        return self._next_offset.get(partition)

    def add(
        self, message: ScoredInput, partition: int, offset: int, now: float, trainer_version: int = 0
    ) -> list[GroupResult]:
        """Take one message; returns the group it ended, if any. May raise :class:`ConflictError`."""
        self.mark_seen(partition, offset)
        header = _header(message)
        task_id = header.task_id
        if self.outcomes.known(task_id):
            return []
        groups = self._open.setdefault(partition, {})
        group = groups.get(task_id)
        if group is None:
            group = OpenGroup(task_id, header.group_size, header.is_eval, now, partition, offset, offset)
        if isinstance(message, TaskFailed):
            group.max_offset = max(group.max_offset, offset)
            groups.pop(task_id, None)
            return [self._ended(drop_of(group, "task_failed", message.reason), now)]
        if header.group_size != group.group_size:
            raise ConflictError(
                f"task {group.task_id}: group_size {header.group_size} differs from the open "
                f"group's {group.group_size}"
            )
        groups[task_id] = group
        group.max_offset = max(group.max_offset, offset)
        group.samples.setdefault(header.sample_idx, message)  # type: ignore[union-attr]  # not a TaskFailed here
        if isinstance(message, ScoredEpisode) and message.episode.images:
            group.images.update(message.episode.images)
        if len(group.samples) < group.group_size or group.missing_images():
            return []
        del groups[task_id]
        return [self._ended(self._finish(group, trainer_version), now)]

    def _finish(self, group: OpenGroup, trainer_version: int) -> GroupResult:
        samples = [s for _, s in sorted(group.samples.items())]
        accepted = [s for s in samples if isinstance(s, ScoredEpisode)]
        failures = [s for s in samples if isinstance(s, SampleRejected) and s.failed]
        rejected = len(samples) - len(accepted) - len(failures)
        if not accepted:
            return _no_accepted(group, rejected, failures)
        shown = {d for s in accepted for row in s.episode.row_images for d in row}
        complete = CompleteGroup(
            group.task_id, group.group_size, group.is_eval, tuple(accepted), rejected,
            group.partition, group.min_offset, group.max_offset, group.first_seen, len(failures),
            images={d: data for d, data in group.images.items() if d in shown},
        )
        return apply_filters(complete, self.filters, trainer_version)

    def _ended(self, result: GroupResult, now: float) -> GroupResult:
        outcome = "emitted" if isinstance(result, CompleteGroup) else "dropped"
        self.outcomes.record(result.task_id, outcome, now, result.partition, result.max_offset)
        return result

    def expire(self, now: float) -> list[DroppedGroup]:
        """Drop ("timeout") every group open for ``group_timeout_seconds`` or longer."""
        cutoff = now - self.group_timeout_seconds
        dropped: list[DroppedGroup] = []
        for groups in self._open.values():
            for task_id in [t for t, g in groups.items() if g.first_seen <= cutoff]:
                group = groups.pop(task_id)
                detail = f"{len(group.samples)} of {group.group_size} samples after {now - group.first_seen:.1f}s"
                if len(group.samples) >= group.group_size:
                    detail += f", {len(group.missing_images())} of its images never arrived"
                drop = drop_of(group, "timeout", detail)
                self._ended(drop, now)
                dropped.append(drop)
        return dropped

    def revoke(self, partitions: Collection[int]) -> None:
        """Forget the open groups, offsets and outcomes of ``partitions``."""
        for partition in partitions:
            self._open.pop(partition, None)
            self._next_offset.pop(partition, None)
        self.outcomes.revoke(partitions)


def _header(message: ScoredInput) -> Episode | SampleRejected | TaskFailed:
    """What holds the message's ``task_id``, ``group_size``, ``is_eval`` (and ``sample_idx``)."""
    return message.episode if isinstance(message, ScoredEpisode) else message

"""How recent groups ended: the in-memory side of the grouping changelog.

The grouping consumer records every ended group here (and, in the same Kafka transaction as
the group's emitted or dropped record, in the compacted changelog). After a crash or a rebalance the new
partition owner restores this log from the changelog and skips every message of a task it finds here,
so a group whose records are re-read from the uncommitted input is never emitted twice.

Times are the caller's monotonic clock (``now``); the changelog carries wall-clock times,
converted on :meth:`OutcomeLog.restore`. Memory is bounded by the groups that ended within
``window_seconds`` (plus those whose records the committed offset has not passed yet).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from rollstream.wire import GroupOutcome

Outcome = Literal["emitted", "dropped"]


@dataclass(frozen=True)
class OutcomeEntry:
    """One ended group: how, when (monotonic), and where its last record is."""

    outcome: Outcome
    at: float
    partition: int
    max_offset: int


class OutcomeLog:
    """task_id -> :class:`OutcomeEntry` for the groups that ended recently."""

    def __init__(self, window_seconds: float) -> None:
        if window_seconds < 0:
            raise ValueError("grouping.dedupe_window_seconds must be >= 0")
        self.window_seconds = window_seconds
        # insertion order is (roughly) time order, which lets expiry stop at the first young entry
        self._entries: dict[str, OutcomeEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, task_id: str, outcome: Outcome, at: float, partition: int, max_offset: int) -> None:
        """Remember that ``task_id`` ended (a later record for the same task replaces it)."""
        self._entries.pop(task_id, None)
        self._entries[task_id] = OutcomeEntry(outcome, at, partition, max_offset)

    def known(self, task_id: str) -> bool:
        return task_id in self._entries

    def get(self, task_id: str) -> OutcomeEntry | None:
        return self._entries.get(task_id)

    def forget(self, task_id: str) -> None:
        self._entries.pop(task_id, None)

    def restore(self, outcomes: Iterable[GroupOutcome], now: float, wall_now: float) -> int:
        """Load changelog records; their wall-clock ``at`` becomes an age relative to ``now``.

        Returns how many entries were loaded. Records must already have tombstones applied.
        """
        loaded = 0
        for outcome in sorted(outcomes, key=lambda o: o.at):
            age = max(0.0, wall_now - outcome.at)
            self.record(outcome.task_id, outcome.outcome, now - age, outcome.source_partition, outcome.max_offset)
            loaded += 1
        return loaded

    def expired(self, now: float, watermarks: Mapping[int, int]) -> list[tuple[str, int]]:
        """Forget and return ``(task_id, partition)`` of entries that may be tombstoned.

        An entry expires once it is older than the window AND its last record lies below its
        partition's committed watermark (a re-read from that offset cannot meet the group's
        records again). Entries of partitions without a watermark are kept.
        """
        cutoff = now - self.window_seconds
        gone: list[tuple[str, int]] = []
        for task_id, entry in self._entries.items():
            if entry.at > cutoff:
                break
            watermark = watermarks.get(entry.partition)
            if watermark is not None and entry.max_offset < watermark:
                gone.append((task_id, entry.partition))
        for task_id, _ in gone:
            del self._entries[task_id]
        return gone

    def revoke(self, partitions: Collection[int]) -> None:
        """Forget the entries of ``partitions`` (their new partition owner restores them)."""
        wanted = set(partitions)
        for task_id in [t for t, e in self._entries.items() if e.partition in wanted]:
            del self._entries[task_id]

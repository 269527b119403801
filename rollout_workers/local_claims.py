"""What a rollout worker knows about prompt records without asking Redis.

Redis says who runs which prompt record (``rollout_workers/claims.py``), but a worker needs
Redis for none of the records it can answer for itself, and must not trust Redis for them when
Redis came back older (its claims then say less than the truth):

- a record running in this process is MINE;
- a record that finished here (every sample published) is DONE until an offset commit of
  this worker passes it (then nobody reads it again);
- a record of a partition at or beyond the partition's *fresh frontier* (its last stable offset
  when this worker took the partition) was never fetched by anyone before: the previous partition
  owner lost the partition before this worker took it, and could only ever have fetched below the
  last stable offset of its time, which is no later than this one. Such a record may run
  without a claim while Redis cannot be reached; its claim is written once Redis answers.

Everything else needs Redis. Pure bookkeeping, no I/O: the runner and the intake keep it
current; what callers may rely on is stated per method.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka.structs import TopicPartition

Record = tuple[TopicPartition, int]


class Known(enum.Enum):
    MINE = "mine"  # running in this process
    DONE = "done"  # finished (here, or found done), not committed past yet


@dataclass
class _Partition:
    finished: dict[int, str] = field(default_factory=dict)  # offset -> record identity
    fresh_from: int | None = None  # None: nothing is known to be fresh (not taken, or unknown)
    lost: bool = False  # taken, then moved away
    # finished records of a lost partition above its last commit here, once nothing of it runs
    # here: DONE to this worker, never written again (its new partition owner commits past them
    # and deletes their claims)
    left_behind: dict[int, str] = field(default_factory=dict)


class LocalClaims:
    """Running and finished records, and each taken partition's fresh frontier."""

    def __init__(self) -> None:
        self.running: dict[Record, str] = {}  # -> record identity
        self._partitions: dict[TopicPartition, _Partition] = {}

    def _part(self, tp: TopicPartition) -> _Partition:
        return self._partitions.setdefault(tp, _Partition())

    # -- partitions --

    def taken(self, tp: TopicPartition, last_stable_offset: int | None) -> None:
        """This worker took ``tp``; ``last_stable_offset`` as of now (None: unknown, so no
        record of it counts as fresh)."""
        part = self._part(tp)
        part.fresh_from, part.lost = last_stable_offset, False
        part.finished.update(part.left_behind)  # above the commit point: read again, found DONE
        part.left_behind.clear()

    def lost(self, tp: TopicPartition) -> None:
        """``tp`` moved away: nothing of it is fresh any more. The release's commit forgot the
        finished records it passed (:meth:`committed`); those it could not pass (a record still
        running below them, held, or a commit that failed) are above the commit point. Once
        nothing of ``tp`` runs here they are no longer written again (:meth:`to_assert`: that
        would be over the deletion of the new partition owner, which commits past them), but
        stay DONE to this worker, so that taking ``tp`` back before Redis holds their done
        claims (written when Redis answers) does not run them again."""
        part = self._part(tp)
        part.fresh_from, part.lost = None, True
        self._leave_behind_if_lost(tp)

    def _leave_behind_if_lost(self, tp: TopicPartition) -> None:
        part = self._part(tp)
        if part.lost and not any(key[0] == tp for key in self.running):
            part.left_behind.update(part.finished)
            part.finished.clear()

    # -- records --

    def known(self, tp: TopicPartition, offset: int, identity: str) -> Known | None:
        """MINE or DONE when this worker can answer for the record; None: ask Redis. A record
        with another identity at the same offset (a recreated topic) is not this one."""
        if self.running.get((tp, offset)) == identity:
            return Known.MINE
        part = self._part(tp)
        if identity in (part.finished.get(offset), part.left_behind.get(offset)):
            return Known.DONE
        return None

    def fresh(self, tp: TopicPartition, offset: int) -> bool:
        """True when nobody else can have fetched the record (see the module docstring)."""
        frontier = self._part(tp).fresh_from
        return frontier is not None and offset >= frontier

    def started(self, tp: TopicPartition, offset: int, identity: str) -> None:
        self.running[(tp, offset)] = identity

    def stopped(self, tp: TopicPartition, offset: int) -> None:
        """The record's run was cancelled (it did not finish)."""
        self.running.pop((tp, offset), None)

    def finished(self, tp: TopicPartition, offset: int, identity: str) -> None:
        """Every sample of the record is published (here), or its claim says done."""
        self.running.pop((tp, offset), None)
        self._part(tp).finished[offset] = identity
        self._leave_behind_if_lost(tp)

    def committed(self, tp: TopicPartition, offset: int) -> list[int]:
        """This worker committed ``tp`` up to ``offset``: the finished records below it are
        forgotten (nobody reads them again) and returned, so their claims can be deleted."""
        part = self._part(tp)
        passed = sorted(o for o in part.finished if o < offset)
        for o in passed:
            del part.finished[o]
        return passed

    def to_assert(self) -> list[tuple[TopicPartition, int, str, bool]]:
        """Every record this worker answers for, as ``(tp, offset, identity, done)``: what it
        writes again when Redis may have forgotten it (after a restart, an outage)."""
        mine = [(tp, o, ident, False) for (tp, o), ident in sorted(self.running.items())]
        done = [(tp, o, ident, True) for tp, part in sorted(self._partitions.items())
                for o, ident in sorted(part.finished.items())]
        return mine + done

    def running_on(self, tps: Iterable[TopicPartition]) -> int:
        wanted = set(tps)
        return sum(tp in wanted for tp, _ in self.running)

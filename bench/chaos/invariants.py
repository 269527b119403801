"""The chaos run's invariants, as plain functions of what was observed (no broker, no Redis).

Each returns the :class:`Violation` s it finds (empty: the invariant held on what it was shown).
They are written to raise no false alarm: where an observation is late or coarse (a version
seen in the trainer's ledger, a record's millisecond timestamp), the check errs towards
accepting. What each one reads:

- ``ends exactly once``: the task ids on ``prompts`` and the ledger of ``batches``
  (:class:`~harness.ledger.Ledger`): every admitted prompt is one group or one counted drop.
- ``trained at most once``: the trainer's own ledger (``rollstream.trainer.ledger``): no task
  id in two committed steps, and only groups that are on ``batches``.
- ``staleness bound``: ``admitted - dropped <= (eta + v + 1) * B`` at every admission, with ``v``
  the trainer's version. Two views: samples of the Redis counters while the run goes on
  (:func:`budget_excess`), and every admission afterwards from the topics (:func:`admission_excess`).
- ``versions only go up``: the trainer's steps, the version in Redis (except after a restart
  that may have lost data, until the trainer published again), each sample's tokens, and the
  batches of each ``batches`` partition (never tagged below an earlier known tag there).
- ``token versions in bounds``: each batch's tokens against its head, tail and trainer version.
- ``trained within eta``: no group reaches a training step more than eta versions behind the
  version that step trains (the trainer's ledger: step ``s`` trains version ``s - 1``).
- ``nothing in flight``: at the end every admitted prompt ended and no tier has records left.
- ``tokens tagged with the weights that made them`` (a run on a vLLM server): every generated
  token's logprob, recomputed by a forward pass of the weights of its tag, is the one the server
  gave (``bench/chaos/audit.py``).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from harness.ledger import Ledger
from harness.logprob_audit import LogprobTagAudit
from rollstream.trainer.ledger import LedgerEntry
from rollstream.wire import EmittedGroup
from rollstream.wire.codec import group_arrays


ENDS_ONCE = "ends exactly once"
TRAINED_ONCE = "trained at most once"
STALENESS = "staleness bound"
VERSIONS_UP = "versions only go up"
TOKEN_VERSIONS = "token versions in bounds"
TRAINED_STALENESS = "trained within eta"
IN_FLIGHT = "nothing in flight"
LOGPROB_TAGS = "tokens tagged with the weights that made them"
INVARIANTS = (ENDS_ONCE, TRAINED_ONCE, STALENESS, VERSIONS_UP, TOKEN_VERSIONS, TRAINED_STALENESS, IN_FLIGHT,
              LOGPROB_TAGS)


@dataclass(frozen=True)
class Violation:
    """One breach: which invariant, what was seen, and when (wall time; 0.0: at the end)."""

    invariant: str
    saw: str
    at: float = 0.0


def floor_ms(seconds: float) -> float:
    """``seconds`` cut to whole milliseconds, as Kafka stamps records: a version compared with a
    record's timestamp must not look later than it was."""
    return math.floor(seconds * 1000) / 1000


def clock(seconds: float) -> str:
    """A wall time as the logs write it (UTC, milliseconds)."""
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds * 1000) % 1000:03d}"


# -- ends exactly once --


def repeated_ends(ledger: Ledger, task_ids: Iterable[str], at: float = 0.0) -> list[Violation]:
    """``task_ids`` (just read from ``batches``) that have now ended more than once, as a group
    or a drop, or whose rows repeat ``(task_id, sample_idx)``."""
    found = []
    for task in task_ids:
        ends = ledger.emitted[task] + ledger.dropped[task]
        if ends > 1:
            found.append(Violation(ENDS_ONCE, f"task {task} ended {ends} times (emitted {ledger.emitted[task]}, "
                                              f"dropped {ledger.dropped[task]})", at))
    return found


def repeated_rows(ledger: Ledger, rows: Iterable[tuple[str, int]], at: float = 0.0) -> list[Violation]:
    return [Violation(ENDS_ONCE, f"row {task}/{idx} emitted {ledger.rows[(task, idx)]} times", at)
            for task, idx in rows if ledger.rows[(task, idx)] > 1]


def accounting(admitted: set[str], prompt_records: int, ledger: Ledger) -> list[Violation]:
    """The end: every admitted prompt ended once, nothing ended that was not admitted, no prompt
    published twice, nothing undecodable on ``batches``."""
    found = [Violation(ENDS_ONCE, problem) for problem in ledger.check(admitted)]
    if prompt_records != len(admitted):
        found.append(Violation(ENDS_ONCE, f"{prompt_records - len(admitted)} prompts published twice "
                                          f"({prompt_records} records for {len(admitted)} task ids)"))
    return found


# -- trained at most once --


def trained_twice(entries: Sequence[LedgerEntry], at: float = 0.0) -> list[Violation]:
    """Task ids in more than one step of the trainer's ledger (or twice in one step)."""
    steps: dict[str, list[int]] = {}
    for entry in entries:
        for task in entry.task_ids:
            steps.setdefault(task, []).append(entry.step)
    return [Violation(TRAINED_ONCE, f"task {task} trained in steps {found}", at)
            for task, found in steps.items() if len(found) > 1]


def trained_unknown(entries: Sequence[LedgerEntry], emitted: set[str]) -> list[Violation]:
    """The end: ledger task ids that are no emitted group on ``batches``."""
    unknown = sorted({t for e in entries for t in e.task_ids} - emitted)
    return [Violation(TRAINED_ONCE, f"{len(unknown)} trained task ids are no group on batches: {unknown[:10]}")] \
        if unknown else []


def step_sequence(entries: Sequence[LedgerEntry], at: float = 0.0) -> list[Violation]:
    """The ledger's steps are 1, 2, 3, ...: each version trained once, in order."""
    for index, entry in enumerate(entries, start=1):
        if entry.step != index:
            steps = [e.step for e in entries[max(0, index - 4): index + 2]]
            return [Violation(VERSIONS_UP, f"ledger line {index} is step {entry.step} (steps around it: {steps})", at)]
    return []


# -- the staleness bound --


class VersionTimeline:
    """When each trainer version may first have been seen: the first time its ledger line was
    seen written (``written_at``, before the step's commit and so before its publish), cut to
    whole milliseconds. Taking a version from before its publish can only raise the bound a
    check uses, never lower it: a late observation cannot cause a false alarm."""

    def __init__(self) -> None:
        self._first: dict[int, float] = {}
        self._times: list[float] = []
        self._versions: list[int] = []

    def saw(self, entries: Iterable[LedgerEntry]) -> None:
        changed = False
        for entry in entries:
            at = floor_ms(entry.written_at)
            if entry.step not in self._first or at < self._first[entry.step]:
                self._first[entry.step] = at
                changed = True
        if changed:
            points = sorted((at, step) for step, at in self._first.items())
            self._times, self._versions, high = [], [], 0
            for at, step in points:  # the version at t: the highest step seen written by t
                high = max(high, step)
                self._times.append(at)
                self._versions.append(high)

    def version_at(self, t: float) -> int:
        i = bisect.bisect_right(self._times, t) - 1
        return self._versions[i] if i >= 0 else 0

    @property
    def latest(self) -> int:
        return self._versions[-1] if self._versions else 0


def capacity(eta: int, version: int, groups_per_step: int) -> int:
    return (eta + version + 1) * groups_per_step


def budget_excess(admitted: int, dropped: int, version: int, eta: int, groups_per_step: int,
                  at: float = 0.0) -> Violation | None:
    """One sample of the Redis counters (one MGET) against the bound with the trainer's version
    at the sample (``version``: at least any version a producer could have read then). Between
    admissions ``admitted - dropped`` only falls and the version only rises, and a rebuilt
    budget is never above the one it replaces, so a correct system passes every sample."""
    limit = capacity(eta, version, groups_per_step)
    if admitted - dropped > limit:
        return Violation(STALENESS, f"redis: admitted {admitted} - dropped {dropped} = {admitted - dropped} > "
                                    f"(eta {eta} + v {version} + 1) * B {groups_per_step} = {limit}", at)
    return None


def admission_excess(prompt_times: Sequence[float], drop_times: Sequence[float], versions: VersionTimeline,
                     eta: int, groups_per_step: int) -> list[Violation]:
    """Every train admission from the topics: the n-th prompt by record timestamp ``t`` was
    admitted before ``t``, as were the n - 1 before it, and no drop counted in Redis by ``t`` has
    a ``dropped_at`` after ``t``; so ``n - drops(<= t) <= (eta + v(t) + 1) * B`` in a correct
    system. ``prompt_times`` and ``drop_times`` in seconds, any order."""
    prompts, drops = sorted(prompt_times), sorted(drop_times)
    found = []
    for n, t in enumerate(prompts, start=1):
        version = versions.version_at(t)
        dropped = bisect.bisect_right(drops, t)
        limit = capacity(eta, version, groups_per_step)
        if n - dropped > limit:
            found.append(Violation(STALENESS, f"admission {n} at {clock(t)}: {n} admitted - {dropped} dropped = "
                                              f"{n - dropped} > (eta {eta} + v {version} + 1) * B {groups_per_step} = "
                                              f"{limit} (excess {n - dropped - limit})", t))
    return found


# -- versions only go up --


def version_regression(previous: int, current: int, forgetting: bool, at: float = 0.0) -> Violation | None:
    """Two readings of the version in Redis, in order. It never goes down, except after a
    restart that may have lost Redis's data (``forgetting``: without persistence, from an
    earlier snapshot, an AOF that lost its last second) until the trainer publishes above
    every version before (``previous`` is the highest seen). Readers never see it go down
    (``batch_tag_regression``, the trainer's steps): this is Redis's own key."""
    if current >= previous or forgetting:
        return None
    return Violation(VERSIONS_UP, f"redis version went from {previous} to {current}", at)


def batch_tag_regression(known_before: int, view: BatchView, partition: int, at: float = 0.0) -> Violation | None:
    """A batch on a partition whose earlier batches carried a known trainer version
    ``known_before``: its own is never below (a grouping instance keeps its version and takes
    the tags of a partition's changelog as its floor; a Redis that came back older moves none)."""
    if view.trainer_version >= known_before:
        return None
    return Violation(VERSIONS_UP, f"group {view.task_id} on batches[{partition}] tagged version "
                                  f"{view.trainer_version}, below the known {known_before} of an earlier batch there", at)


# -- token versions in bounds --


@dataclass(frozen=True)
class BatchView:
    """What the version checks read from one ``EmittedGroup`` record."""

    task_id: str
    trainer_version: int
    trainer_version_known: bool
    head_version: int
    tail_version: int
    staleness: int
    versions: np.ndarray  # [N, L] per-token versions
    loss_mask: np.ndarray  # [N, L], 1 on generated tokens


def batch_view(batch: EmittedGroup) -> BatchView:
    arrays = group_arrays(batch)
    return BatchView(
        task_id=batch.task_id, trainer_version=batch.trainer_version,
        trainer_version_known=batch.trainer_version_known,
        head_version=batch.head_version, tail_version=batch.tail_version, staleness=batch.staleness,
        versions=np.asarray(arrays["versions"]), loss_mask=np.asarray(arrays["loss_mask"]),
    )


def batch_versions(view: BatchView, at: float = 0.0) -> list[Violation]:
    """Every generated token's version is a real one (>= 0) within the batch's [head, tail],
    each sample's versions never go down along its tokens, the trainer version is not older
    than the newest token unless the batch says it does not know it, and the staleness is
    ``trainer_version - head``."""
    found: list[Violation] = []
    name = f"group {view.task_id}"
    generated = view.loss_mask.astype(bool)
    tokens = view.versions[generated]
    if tokens.size:
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or low < view.head_version or high > view.tail_version:
            found.append(Violation(TOKEN_VERSIONS, f"{name}: generated tokens carry versions {low}..{high} outside "
                                                   f"head {view.head_version} .. tail {view.tail_version}", at))
        for row in range(view.versions.shape[0]):
            seq = view.versions[row][generated[row]]
            if seq.size > 1 and bool(np.any(np.diff(seq) < 0)):
                found.append(Violation(VERSIONS_UP, f"{name} row {row}: token versions go down along the sample "
                                                    f"({seq.tolist()[:16]})", at))
                break
    if view.trainer_version_known and view.trainer_version < view.tail_version:
        found.append(Violation(TOKEN_VERSIONS, f"{name}: trainer version {view.trainer_version} older than its "
                                               f"newest token (tail {view.tail_version}) and said to be known", at))
    if view.head_version >= 0 and view.staleness != view.trainer_version - view.head_version:
        found.append(Violation(TOKEN_VERSIONS, f"{name}: staleness {view.staleness} != trainer version "
                                               f"{view.trainer_version} - head {view.head_version}", at))
    return found


# -- trained within eta --


def trained_staleness(entry: LedgerEntry, heads: dict[str, int], eta: int, at: float = 0.0) -> list[Violation]:
    """The groups step ``entry.step`` trained, against the version it trains (``step - 1``, as
    the example trainer publishes one version per step): none more than ``eta`` behind. A
    group whose head is unknown yet (its batch not read) is left to a later look."""
    version = entry.step - 1
    return [Violation(TRAINED_STALENESS, f"step {entry.step} trained group {task} of head version {heads[task]}: "
                                         f"{version - heads[task]} versions behind version {version} (eta {eta})", at)
            for task in entry.task_ids if task in heads and heads[task] >= 0 and version - heads[task] > eta]


# -- nothing in flight --


def left_in_flight(admitted: set[str], ledger: Ledger, lags: dict[str, int], trainer_waiting: int,
                   trainer_step: int) -> list[Violation]:
    """The end: every admitted prompt ended, no tier's consumer group has records after its
    committed offsets (``lags``: group -> records), and the trainer waits on fewer groups than
    one step (``trainer_waiting``: groups after its committed offsets; it trains whole steps)."""
    found = []
    open_tasks = admitted - ledger.accounted
    if open_tasks:
        found.append(Violation(IN_FLIGHT, f"{len(open_tasks)} admitted prompts never ended: {sorted(open_tasks)[:10]}"))
    for group, lag in sorted(lags.items()):
        if lag:
            found.append(Violation(IN_FLIGHT, f"{group}: {lag} records after its committed offsets"))
    if trainer_waiting >= trainer_step:
        found.append(Violation(IN_FLIGHT, f"trainer: {trainer_waiting} groups after its committed offsets, "
                                          f"a whole step ({trainer_step}) or more"))
    return found


def by_invariant(violations: Iterable[Violation]) -> Counter[str]:
    return Counter(v.invariant for v in violations)


def logprob_tags(audit: LogprobTagAudit) -> list[Violation]:
    """One violation per mis-tagged token found by the logprob audit (its examples say which)."""
    if not audit.mistagged:
        return []
    shown = "; ".join(audit.examples[:5])
    return [Violation(LOGPROB_TAGS, f"{audit.mistagged} of {audit.tokens} generated tokens disagree with the weights "
                                    f"of their tag: {shown}")]

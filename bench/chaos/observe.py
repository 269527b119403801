"""What the chaos run watches while it runs, and the checks it makes as it watches.

:class:`Observer` is fed by the run: every record of ``prompts`` (:meth:`Observer.on_prompt`,
from a :class:`~harness.ledger.TopicFollower`) and of ``batches`` (:meth:`Observer.on_batch`,
the pipeline's batches watcher); it polls the trainer's ledger file and samples the staleness
counters and the version in Redis. Each observation goes through the plain functions of
:mod:`bench.chaos.invariants`, and every violation is printed the moment it is found.

A Redis sample is checked against the trainer's version only once the ledger has been read
after the sample was taken: a version a producer could have read by then has its ledger line
written by then (the line precedes the step's commit, which precedes its publish).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path

from aiokafka import ConsumerRecord
from redis.exceptions import RedisError

from bench.chaos import invariants as inv
from harness.ledger import Ledger
from rollstream.config import RollstreamConfig
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys, connect
from rollstream.trainer.ledger import LedgerEntry, StepLedger
from rollstream.wire import EmittedGroup, GroupDropped, decode_prompt


log = logging.getLogger(__name__)

LEDGER_POLL_SECONDS = 1.0
REDIS_SAMPLE_SECONDS = 0.5


class Observer:
    """The run's eyes; :meth:`watch` runs the polling loops until cancelled."""

    def __init__(self, config: RollstreamConfig, ledger_path: Path) -> None:
        self.config = config
        self.eta = config.staleness.max_head_offpolicyness
        self.groups_per_step = config.staleness.groups_per_step
        self.ledger_file = StepLedger(ledger_path)
        self.ledger = Ledger()  # of batches: the pipeline's (see follow), filled before on_batch is called
        self.violations: list[inv.Violation] = []
        self._reported: set[tuple[str, str]] = set()
        # prompts
        self.prompts: dict[str, float] = {}  # train task id -> its record's timestamp (seconds)
        self.prompt_records = 0  # every record, eval and repeats included
        # batches
        self.drop_times: list[float] = []  # dropped_at of every train drop
        self.heads: dict[str, int] = {}  # task -> the head version of its emitted group
        self.known_tags: dict[int, int] = {}  # batches partition -> the newest known trainer version tagged there
        self.batches_checked = 0
        self.tokens_checked = 0
        # the trainer's ledger
        self.timeline = inv.VersionTimeline()
        self.entries: list[LedgerEntry] = []
        self.steps_redone = 0  # ledger lines that vanished (a crash between the line and its commit)
        self._ledger_read_at = 0.0
        # redis
        self.redis_samples = 0
        self.redis_unreadable = 0
        self.worst_budget: tuple[int, str] | None = None  # (admitted - dropped - capacity, the sample)
        self.highest_version = 0
        self._forgetting = False  # Redis may have lost data (or is about to): its version may read less
        self._back_at: float | None = None  # when Redis came back from the last such restart
        self._high_before = 0  # the highest version seen before it
        self._pending: deque[tuple[float, int, int]] = deque()  # (time, admitted, dropped)

    # -- violations --

    def report(self, found: inv.Violation | list[inv.Violation] | None) -> None:
        """Keep and print each violation once (a poll that sees the same breach again adds nothing)."""
        for violation in [found] if isinstance(found, inv.Violation) else (found or []):
            key = (violation.invariant, violation.saw)
            if key in self._reported:
                continue
            self._reported.add(key)
            self.violations.append(violation)
            print(f"{time.strftime('%H:%M:%S')} VIOLATION [{violation.invariant}] {violation.saw}", flush=True)

    # -- topics --

    def follow(self, ledger: Ledger) -> None:
        """Read ``batches`` through ``ledger``, the one the pipeline's watcher fills."""
        self.ledger = ledger

    def on_prompt(self, record: ConsumerRecord) -> None:
        task = decode_prompt(record.value)
        self.prompt_records += 1
        if task.is_eval:
            return
        if task.task_id in self.prompts:
            self.report(inv.Violation(inv.ENDS_ONCE, f"prompt {task.task_id} published twice", time.time()))
            return
        self.prompts[task.task_id] = record.timestamp / 1000

    def on_batch(self, record: ConsumerRecord, message: EmittedGroup | GroupDropped) -> None:
        now = time.time()
        if isinstance(message, GroupDropped):
            if not message.is_eval:
                self.drop_times.append(message.dropped_at)
            self.report(inv.repeated_ends(self.ledger, [message.task_id], now))
            return
        self.report(inv.repeated_ends(self.ledger, [message.task_id], now))
        rows = [(message.task_id, i) for i in message.sample_idx]
        self.report(inv.repeated_rows(self.ledger, rows, now))
        view = inv.batch_view(message)
        self.report(inv.batch_versions(view, now))
        self.report(inv.batch_tag_regression(self.known_tags.get(record.partition, 0), view, record.partition, now))
        if message.trainer_version_known:
            self.known_tags[record.partition] = max(self.known_tags.get(record.partition, 0), message.trainer_version)
        self.heads[message.task_id] = message.head_version
        self.batches_checked += 1
        self.tokens_checked += int(view.loss_mask.sum())

    # -- polling --

    def redis_forgets(self) -> None:
        """The run is about to restart Redis in a way that may lose data (without persistence,
        from an earlier snapshot, after a crash with an AOF fsynced every second): from now on
        its version may read less, until a version above every one before is read from the
        Redis that came back (:meth:`redis_back`): the trainer published again."""
        self._forgetting, self._back_at, self._high_before = True, None, self.highest_version

    def redis_back(self) -> None:
        """Redis answers again after such a restart."""
        self._back_at = time.time()

    @property
    def stale_times(self) -> list[float]:
        """When each group the trainer dropped as stale was dropped (its step's ledger line: no
        later than its slot returned)."""
        return [e.written_at for e in self.entries for _ in e.stale]

    async def watch(self) -> None:
        await asyncio.gather(self._poll_ledger(), self._sample_redis())

    async def _poll_ledger(self) -> None:
        while True:
            self.read_ledger()
            await asyncio.sleep(LEDGER_POLL_SECONDS)

    def read_ledger(self) -> list[LedgerEntry]:
        """Read the trainer's ledger now, check it, and check the Redis samples it covers."""
        read_at = time.time()
        entries, _torn = self.ledger_file.read_checked()
        kept = {(e.step, tuple(e.task_ids)) for e in entries}
        self.steps_redone += sum((e.step, tuple(e.task_ids)) not in kept for e in self.entries)
        self.entries = entries
        self.timeline.saw(entries)
        self.report(inv.trained_twice(entries, read_at))
        self.report(inv.step_sequence(entries, read_at))
        for entry in entries:
            self.report(inv.trained_staleness(entry, self.heads, self.eta, read_at))
        self._ledger_read_at = read_at
        self._check_samples()
        return entries

    def _check_samples(self) -> None:
        while self._pending and self._pending[0][0] < self._ledger_read_at:
            at, admitted, dropped = self._pending.popleft()
            version = self.timeline.version_at(at)
            self.report(inv.budget_excess(admitted, dropped, version, self.eta, self.groups_per_step, at))
            over = admitted - dropped - inv.capacity(self.eta, version, self.groups_per_step)
            if self.worst_budget is None or over > self.worst_budget[0]:
                self.worst_budget = (over, f"admitted {admitted}, dropped {dropped}, trainer version {version}")

    def sampled(self, at: float, admitted: int, dropped: int, version: int) -> None:
        """One reading of Redis taken by ``at``: the version is checked now, the budget once the
        ledger has been read after ``at``."""
        self.redis_samples += 1
        self._pending.append((at, admitted, dropped))
        self.report(inv.version_regression(self.highest_version, version, self._forgetting, at))
        if version > self._high_before and self._back_at is not None and at > self._back_at:
            self._forgetting = False  # read from the Redis that came back: the trainer published again
        self.highest_version = max(self.highest_version, version)

    async def _sample_redis(self) -> None:
        exp = self.config.experiment
        redis = connect(self.config.redis)
        budget = StalenessBudget(redis, RedisKeys(exp.experiment_name, exp.trial_name), self.eta, self.groups_per_step)
        try:
            while True:
                try:
                    usage = await budget.read()  # one script: a consistent snapshot
                except (RedisError, OSError, ValueError):
                    self.redis_unreadable += 1
                else:  # every returned slot counts: grouping's drops and the trainer's stale ones
                    self.sampled(time.time(), usage.admitted, usage.dropped + usage.trainer_dropped, usage.version)
                await asyncio.sleep(REDIS_SAMPLE_SECONDS)
        finally:
            await redis.aclose()

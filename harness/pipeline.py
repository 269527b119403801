"""A whole pipeline as separate tier processes, for the fault tests and ``bench.chaos``.

:class:`Pipeline` writes one YAML config for every tier (:func:`harness.configs.pipeline_config` builds it),
starts each tier as its own process (:class:`~harness.tiers.TierProcess`), follows ``batches``
with a :class:`~harness.ledger.BatchesWatcher`, and, unless told that a real trainer runs
(``stand_in_trainer=False``: ``rollstream train`` as one more tier), acts as the trainer: every
``staleness.groups_per_step`` emitted groups it publishes the next weight version (the tiny model's
own weights) to Redis, which is what lets the producer admit more prompts; a version step takes
at least ``step_seconds`` (the trainer is the pace-setter, as in real RL runs, which spreads the
run, and so the faults, over time). Like an orchestrator it restarts a tier process that exits
when nobody asked it to, and counts that.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiokafka import ConsumerRecord
from redis.exceptions import RedisError

from harness.ledger import BatchesWatcher, Ledger, read_topic
from harness.tiers import TierProcess
from harness.waits import stop_task
from rollstream.api.engine import WeightUpdate
from rollstream.config import RollstreamConfig, config_from_dict
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.topics import TopicNames
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys, connect
from rollstream.state.version_store import VersionStore
from rollstream.wire import EmittedGroup, Episode, GroupDropped, SampleRejected, decode_episode, decode_prompt


log = logging.getLogger(__name__)

BatchHook = Callable[[ConsumerRecord, EmittedGroup | GroupDropped], None]

TICK_SECONDS = 0.25


def write_dataset(path: Path, n: int) -> Path:
    with path.open("w") as handle:
        for i in range(n):
            a, b = i % 17, (3 * i) % 13
            handle.write(json.dumps({"prompt": f"What is {a}+{b}?", "answer": str(a + b)}) + "\n")
    return path


@dataclass
class Outcome:
    """The run's figures, as the test prints them."""

    prompts: int
    admitted: int
    prompt_records: int
    emitted: int
    dropped: dict[str, int]
    duplicate_tasks: int
    duplicate_rows: int
    problems: list[str]
    versions: int
    seconds: float
    episode_records: int = 0  # samples published on episodes, re-runs included
    distinct_samples: int = 0  # distinct (task_id, sample_idx) among them
    budget: dict[str, int] = field(default_factory=dict)  # the staleness counters in Redis
    kills: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    unexpected_exits: dict[str, list[int]] = field(default_factory=dict)


class Pipeline:
    """The tiers of one experiment, supervised; use ``async with``."""

    def __init__(self, tree: dict[str, Any], workdir: Path, model: Path, step_seconds: float = 1.5,
                 stand_in_trainer: bool = True, on_batch: BatchHook | None = None) -> None:
        self.tree = tree
        self.stand_in_trainer = stand_in_trainer
        self.step_seconds = step_seconds
        self.config: RollstreamConfig = config_from_dict(tree)
        self.names = TopicNames.of(self.config)
        self.model = model
        self.config_file = workdir / "pipeline.yaml"
        self.config_file.write_text(yaml.safe_dump(tree))
        self.log_dir = workdir / "logs"
        self.log_dir.mkdir(exist_ok=True)
        self.tiers: dict[str, TierProcess] = {}
        self.prompts = int(tree["producer"].get("max_prompts") or 0)  # 0: producers without an end
        self.watcher = BatchesWatcher(self.config.kafka, self.names.batches, on_batch)
        self.version = 0
        self.hold_versions = False  # True: the trainer publishes nothing (the pipeline drains)
        self.published_at: list[tuple[float, int]] = [(0.0, 0)]  # (wall time just before, version) per publish
        self.started = time.monotonic()
        self._trainer: asyncio.Task[None] | None = None
        self._redis = connect(self.config.redis)
        self._store_keys = RedisKeys(self.config.experiment.experiment_name, self.config.experiment.trial_name)
        self._store = VersionStore(self._redis, self._store_keys)

    def add(self, name: str, tier: str, *overrides: str, args: list[str] | None = None) -> TierProcess:
        """A tier process named ``name`` (its log: ``logs/<name>.log``), not started yet."""
        process = TierProcess(tier, self.config_file, self.log_dir / f"{name}.log", overrides=list(overrides),
                              args=args, name=name)
        self.tiers[name] = process
        return process

    async def __aenter__(self) -> Pipeline:
        await ensure_topics(self.config.kafka, self.names)
        await self.watcher.__aenter__()
        if self.stand_in_trainer:
            self._trainer = asyncio.create_task(self._train(), name="stand-in-trainer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._trainer is not None:
            await stop_task(self._trainer, "the stand-in trainer")
        for process in self.tiers.values():
            process.signal_stop()  # all at once: each drains in parallel
        for process in self.tiers.values():
            await asyncio.to_thread(process.stop, 30.0)
        await self.watcher.__aexit__()
        await self._redis.aclose()

    @property
    def ledger(self) -> Ledger:
        return self.watcher.ledger

    def progress(self) -> float:
        """Fraction of the prompts whose group has ended (emitted or dropped); 0 without an end."""
        return len(self.ledger.accounted) / self.prompts if self.prompts else 0.0

    async def _train(self) -> None:
        """The stand-in trainer: one version step per ``groups_per_step`` emitted groups."""
        groups_per_step = self.config.staleness.groups_per_step
        while True:
            target = len(self.ledger.emitted) // groups_per_step
            if target > self.version and not self.hold_versions:
                try:
                    # the time BEFORE the publish, in whole ms as Kafka stamps records: producers
                    # may see the version from any moment after it
                    started = int(time.time() * 1000) / 1000
                    await self._store.publish(WeightUpdate(self.version + 1, str(self.model)))
                    self.version += 1
                    self.published_at.append((started, self.version))
                    await asyncio.sleep(self.step_seconds)
                    continue
                except (RedisError, OSError) as exc:
                    log.warning("trainer: redis unavailable (%s); retrying", exc)
            await asyncio.sleep(TICK_SECONDS)

    def supervise(self) -> None:
        """Restart tiers that exited on their own (a finished producer excepted)."""
        self.watcher.check_alive()
        if self._trainer is not None and self._trainer.done():
            self._trainer.result()
        for name, process in self.tiers.items():
            code = process.exit_code()
            if code is None or process.starts == 0 or process.held_down:
                continue
            if process.tier == "producer" and code == 0:
                continue  # the dataset is exhausted: its job is done
            process.unexpected_exits.append(code)
            log.warning("%s exited with %s unasked; restarting it\n%s", name, code, process.tail())
            process.start()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Supervise until ``predicate()``; on timeout fail with the progress and the logs' ends."""
        deadline = time.monotonic() + timeout
        while not predicate():
            self.supervise()
            if time.monotonic() > deadline:
                tails = "\n".join(p.tail(15) for p in self.tiers.values())
                raise AssertionError(
                    f"timed out after {timeout:.0f}s waiting for {what}: {len(self.ledger.accounted)}/"
                    f"{self.prompts} groups ended, version {self.version}\n{tails}"
                )
            await asyncio.sleep(TICK_SECONDS)

    async def sleep(self, seconds: float) -> None:
        """Sleep while supervising."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.supervise()
            await asyncio.sleep(min(TICK_SECONDS, max(0.0, end - time.monotonic())))

    async def in_thread(self, fn: Callable[[], Any], timeout: float, what: str) -> None:
        """Run a blocking ``fn`` (a broker restart) while supervising."""
        job = asyncio.ensure_future(asyncio.to_thread(fn))
        await self.wait_for(job.done, timeout, what)
        job.result()

    def finished(self) -> bool:
        producer = [p for p in self.tiers.values() if p.tier == "producer"]
        return all(p.exit_code() == 0 for p in producer) and len(self.ledger.accounted) >= self.prompts

    async def outcome(self) -> Outcome:
        """Read ``prompts`` and compare with ``batches``: the exact accounting."""
        records = await read_topic(self.config.kafka, self.names.prompts, decode_prompt)
        admitted = {task.task_id for task in records}
        samples = [m for m in await read_topic(self.config.kafka, self.names.episodes, decode_episode)
                   if isinstance(m, (Episode, SampleRejected))]
        budget = StalenessBudget(self._redis, self._store_keys, self.config.staleness.max_head_offpolicyness,
                                 self.config.staleness.groups_per_step)
        ledger = self.ledger
        problems = ledger.check(admitted)
        if len(records) != len(admitted):
            problems.append(f"{len(records) - len(admitted)} prompts were published twice")
        if len(admitted) != self.prompts:
            problems.append(f"{len(admitted)} prompts admitted, expected {self.prompts}")
        return Outcome(
            prompts=self.prompts, admitted=len(admitted), prompt_records=len(records),
            emitted=len(ledger.emitted), dropped=dict(ledger.drop_reasons),
            duplicate_tasks=len(ledger.duplicate_tasks()), duplicate_rows=len(ledger.duplicate_rows()),
            problems=problems, versions=self.version, seconds=time.monotonic() - self.started,
            episode_records=len(samples), distinct_samples=len({(m.task_id, m.sample_idx) for m in samples}),
            budget=await budget.usage(),
            kills={n: p.kills for n, p in self.tiers.items()},
            restarts={n: p.starts - 1 for n, p in self.tiers.items()},
            unexpected_exits={n: p.unexpected_exits for n, p in self.tiers.items() if p.unexpected_exits},
        )

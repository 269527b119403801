"""What the demo shows while it runs: trainer steps, versions, rewards, rates, lag per tier.

:class:`DemoProgress` is fed by the trainer's steps file and by :class:`LagProbe`
(consumer-group offsets against end offsets, the same numbers as ``rollstream status``)
and renders one rich table; with ``live=False`` it prints a plain line per step instead.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from aiokafka.errors import KafkaError
from rich.console import Console
from rich.live import Live
from rich.table import Table

from rollstream.config import RollstreamConfig
from rollstream.demo.report import StepRecord, summary_table
from rollstream.kafka.clients import make_admin, make_consumer
from rollstream.kafka.topics import TopicNames
from rollstream.tools.status import consumer_groups, end_offsets, fill_lag


class LagProbe:
    """Lag of every tier's consumer group on its input topic (async context manager)."""

    def __init__(self, config: RollstreamConfig) -> None:
        self.config = config
        self.names = TopicNames.of(config)
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> LagProbe:
        self.admin = make_admin(self.config.kafka, "demo-lag")
        await self.admin.start()
        self._stack.push_async_callback(self.admin.close)
        self.consumer = make_consumer(self.config.kafka, "demo-lag", group_id=None, read_committed=True)
        await self.consumer.start()
        self._stack.push_async_callback(self.consumer.stop)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def lags(self) -> dict[str, int | None]:
        """Tier -> records its group has not committed yet (None: nothing committed or unknown,
        e.g. no coordinator yet: asked again next time)."""
        groups = [g for g in consumer_groups(self.config, self.names) if g.topic is not None]
        try:
            ends = await end_offsets(self.admin, self.consumer, sorted({g.topic for g in groups if g.topic}))
        except KafkaError:
            return {group.tier: None for group in groups}
        for group in groups:
            await fill_lag(self.admin, group, ends)
        return {group.tier: group.lag for group in groups}


@dataclass
class DemoProgress:
    """The numbers on screen; ``steps`` are the trainer's step records."""

    total_steps: int
    started: float = field(default_factory=time.monotonic)
    steps: list[StepRecord] = field(default_factory=list)
    lags: dict[str, int | None] = field(default_factory=dict)
    phase: str = "starting the pipeline"

    def add_step(self, report: StepRecord) -> None:
        self.steps.append(report)
        self.phase = "training"

    def episodes(self) -> int:
        return sum(s.episodes for s in self.steps)

    def episodes_per_second(self) -> float:
        """Trained episodes per second since the first step finished (0 before the second)."""
        if len(self.steps) < 2:
            return 0.0
        first, last = self.steps[0], self.steps[-1]
        seconds = last.finished_at - first.finished_at
        return (self.episodes() - first.episodes) / seconds if seconds > 0 else 0.0

    def line(self) -> str:
        """One plain-text line for the latest step (``--no-live``)."""
        s = self.steps[-1]
        lag = " ".join(f"{tier}={'-' if v is None else v}" for tier, v in self.lags.items())
        return (
            f"step {s.step}/{self.total_steps} version {s.version} reward {s.reward_mean:.3f} "
            f"episodes/s {self.episodes_per_second():.1f} staleness mean {s.staleness_mean:.2f} "
            f"max {s.staleness_max} ranks {s.ranks} lag {lag or '-'}"
        )

    def render(self) -> Table:
        last = self.steps[-1] if self.steps else None
        recent = [s.reward_mean for s in self.steps[-5:]]
        rows = [
            ("step", f"{len(self.steps)}/{self.total_steps}"),
            ("trainer version", str(last.version) if last else "0"),
            ("reward (last step)", f"{last.reward_mean:.3f}" if last else "-"),
            ("reward (last 5 steps)", f"{sum(recent) / len(recent):.3f}" if recent else "-"),
            ("episodes trained", str(self.episodes())),
            ("episodes/s", f"{self.episodes_per_second():.1f}"),
            ("staleness (mean / max)", f"{last.staleness_mean:.2f} / {last.staleness_max}" if last else "-"),
            ("loss / clip fraction", f"{last.loss:.4f} / {last.clip_fraction:.2f}" if last else "-"),
            ("trainer ranks", str(last.ranks) if last else "-"),
        ]
        rows += [(f"lag {tier}", "-" if lag is None else str(lag)) for tier, lag in self.lags.items()]
        return summary_table(rows, f"rollstream demo: {self.phase} ({time.monotonic() - self.started:.0f}s)")


class ProgressView:
    """A rich Live view of a :class:`DemoProgress`, or plain lines when ``live`` is False."""

    def __init__(self, progress: DemoProgress, console: Console, live: bool) -> None:
        self.progress = progress
        self.console = console
        self._live = Live(progress.render(), console=console, refresh_per_second=2) if live else None

    def __enter__(self) -> ProgressView:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def refresh(self, step_done: bool = False) -> None:
        if self._live is not None:
            self._live.update(self.progress.render())
        elif step_done:
            self.console.print(self.progress.line(), highlight=False, soft_wrap=True)

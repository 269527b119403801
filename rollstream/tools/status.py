"""A one-screen view of an experiment: topic offsets and rates, group lags, version, budget.

``collect`` takes one snapshot (rates come from the previous snapshot's end offsets); the
reward means per version come from a sample of the last ``REWARD_SAMPLE`` records of
``scored`` (cheap, and enough to spot a reward function that went wrong).

Prompts in flight = admitted - emitted - dropped (train prompts: eval prompts never take a
slot). Admitted and dropped come from Redis, emitted groups are counted from ``batches``
(``rollstream.tools.emitted``: read once from the beginning, then only what is new; while
that first read is not finished, the count shown is an upper bound, "<=N"). The budget's
"used" is admitted - dropped: an emitted group keeps its slot until the version moves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import GroupCoordinatorNotAvailableError, KafkaError
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from rollstream.runtime.tasks import wait_event
from rollstream.config import RollstreamConfig
from rollstream.kafka.clients import make_admin, make_consumer
from rollstream.kafka.scan import scan_topic
from rollstream.kafka.topics import TopicNames
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys, connect
from rollstream.tools.emitted import EmittedCount, EmittedCounter
from rollstream.tools.roles import ROLES, topic_for
from rollstream.wire import ScoredEpisode, WireDecodeError, decode_scored

REWARD_SAMPLE = 200
SAMPLE_SECONDS = 2.0


@dataclass
class GroupLag:
    tier: str
    group_id: str
    topic: str | None  # input topic; None for a tier that consumes with no group
    committed: int | None = None  # sum of committed offsets; None when nothing committed
    lag: int | None = None
    error: str | None = None  # why the offsets could not be read


@dataclass
class Snapshot:
    at: float
    experiment: str
    ends: dict[str, dict[int, int]]  # topic -> partition -> end offset
    roles: dict[str, str]  # role -> topic
    rates: dict[str, float | None]
    groups: list[GroupLag]
    usage: dict[str, int]
    drops: dict[str, int]
    reward_by_version: dict[int, tuple[float, int]] = field(default_factory=dict)
    emitted: EmittedCount | None = None  # None: no batches topic yet

    def in_flight(self) -> str:
        """Admitted train prompts with no outcome yet ("<=N" while emitted groups are still being counted)."""
        emitted = self.emitted.groups if self.emitted is not None else 0
        count = self.usage.get("admitted", 0) - emitted - self.usage.get("dropped", 0)
        return str(count) if self.emitted is None or self.emitted.complete else f"<={count}"

    def end_total(self, role: str) -> int:
        return sum(self.ends.get(self.roles[role], {}).values())


def consumer_groups(config: RollstreamConfig, names: TopicNames) -> list[GroupLag]:
    """Every tier's consumer group and the topic whose lag it has."""
    return [
        GroupLag("producer", names.group_id("producer"), None),
        GroupLag("rollout-worker", names.group_id("rollout-worker"), names.prompts),
        GroupLag("reward-worker", names.group_id("reward-worker"), names.episodes),
        GroupLag("grouping", names.group_id("grouping"), names.scored),
        GroupLag("dump", names.group_id("dump"), names.scored),
        GroupLag("trainer", config.trainer.group_id, names.batches),
    ]


async def end_offsets(admin: AIOKafkaAdminClient, consumer: AIOKafkaConsumer,
                      topics: list[str]) -> dict[str, dict[int, int]]:
    """Topic -> partition -> end offset (``consumer``'s view: read_committed gives last stable
    offsets) of each of ``topics`` that exists."""
    existing = set(await admin.list_topics())
    wanted = [topic for topic in topics if topic in existing]
    described = await admin.describe_topics(wanted) if wanted else []
    tps = [
        TopicPartition(entry["topic"], part["partition"])
        for entry in described if entry["error_code"] == 0
        for part in entry["partitions"]
    ]
    ends: dict[str, dict[int, int]] = {}
    for tp, offset in sorted((await consumer.end_offsets(tps) if tps else {}).items()):
        ends.setdefault(tp.topic, {})[tp.partition] = offset
    return ends


async def fill_lag(admin: AIOKafkaAdminClient, group: GroupLag, ends: dict[str, dict[int, int]]) -> None:
    """Set ``group``'s committed offsets and lag on its input topic against ``ends``; its
    ``error`` when the broker cannot say (e.g. no coordinator yet on a fresh broker)."""
    if group.topic is None or group.topic not in ends:
        return
    tps = [TopicPartition(group.topic, p) for p in ends[group.topic]]
    try:
        offsets = await admin.list_consumer_group_offsets(group.group_id, partitions=tps)
    except KafkaError as exc:
        group.error = "no coordinator yet" if isinstance(exc, GroupCoordinatorNotAvailableError) else type(exc).__name__
        return
    committed = {tp.partition: meta.offset for tp, meta in offsets.items() if meta is not None and meta.offset >= 0}
    if committed:
        group.committed = sum(committed.values())
        group.lag = sum(end - committed.get(p, 0) for p, end in ends[group.topic].items())


class StatusCollector:
    """Holds the clients between refreshes; use as an async context manager."""

    def __init__(self, config: RollstreamConfig) -> None:
        self.config = config
        self.names = TopicNames.of(config)
        self._stack = contextlib.AsyncExitStack()
        self._previous: Snapshot | None = None
        self._emitted = EmittedCounter(self.names.batches)

    async def __aenter__(self) -> StatusCollector:
        self.consumer: AIOKafkaConsumer = make_consumer(self.config.kafka, "status", group_id=None, read_committed=True)
        await self.consumer.start()
        self._stack.push_async_callback(self.consumer.stop)
        self.admin: AIOKafkaAdminClient = make_admin(self.config.kafka, "status")
        await self.admin.start()
        self._stack.push_async_callback(self.admin.close)
        self.redis = connect(self.config.redis)
        self._stack.push_async_callback(self.redis.aclose)
        exp = self.config.experiment
        self.budget = StalenessBudget(
            self.redis, RedisKeys(exp.experiment_name, exp.trial_name),
            self.config.staleness.max_head_offpolicyness, self.config.staleness.groups_per_step,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def collect(self) -> Snapshot:
        roles = {role: topic_for(self.names, role) for role in ROLES}
        ends = await end_offsets(self.admin, self.consumer, list(roles.values()))
        now = time.monotonic()
        groups = consumer_groups(self.config, self.names)
        for group in groups:
            await fill_lag(self.admin, group, ends)
        # Redis first: a group emitted while the topic is read then counts as emitted, not as
        # in flight twice (the count can only err towards fewer in flight for that moment).
        usage, drops = await self.budget.usage(), await self.budget.drops_by_reason()
        batch_ends = ends.get(roles["batches"])
        snapshot = Snapshot(
            at=now, experiment=f"{self.names.experiment}/{self.names.trial}", ends=ends, roles=roles,
            rates=self._rates(ends, now), groups=groups, usage=usage, drops=drops,
            reward_by_version=await self._reward_sample(ends.get(roles["scored"], {})),
            emitted=await self._emitted.update(self.config.kafka, batch_ends) if batch_ends is not None else None,
        )
        self._previous = snapshot
        return snapshot

    def _rates(self, ends: dict[str, dict[int, int]], now: float) -> dict[str, float | None]:
        prev = self._previous
        return {
            topic: None if prev is None or now <= prev.at or topic not in prev.ends
            else (sum(partitions.values()) - sum(prev.ends[topic].values())) / (now - prev.at)
            for topic, partitions in ends.items()
        }

    async def _reward_sample(self, ends: dict[int, int]) -> dict[int, tuple[float, int]]:
        """Mean reward per tail version of the last ``REWARD_SAMPLE`` records of ``scored``
        (what the one bounded read gives within ``SAMPLE_SECONDS``)."""
        if not ends:
            return {}
        per_partition = math.ceil(REWARD_SAMPLE / len(ends))
        start = {p: end - per_partition for p, end in ends.items()}
        records = scan_topic(self.config.kafka, self.names.scored, "status", end=ends, partitions=ends, start=start,
                             timeout=SAMPLE_SECONDS)
        sums: dict[int, list[float]] = {}
        with contextlib.suppress(TimeoutError):  # a sample: what was read in time
            async with contextlib.aclosing(records):
                async for record in records:
                    try:
                        message = decode_scored(record.value)
                    except WireDecodeError:
                        continue
                    if isinstance(message, ScoredEpisode):
                        sums.setdefault(message.episode.tail_version, []).append(message.reward)
        return {v: (sum(r) / len(r), len(r)) for v, r in sorted(sums.items())}


def render(snapshot: Snapshot) -> Group:
    """The snapshot as rich tables."""
    topics = _table(f"rollstream {snapshot.experiment}", "role", "topic", "end offset", "rate/s",
                    right=("end offset", "rate/s"))
    for role, topic in snapshot.roles.items():
        rate = snapshot.rates.get(topic)
        exists = topic in snapshot.ends
        topics.add_row(role, topic, str(snapshot.end_total(role)) if exists else "missing", "-" if rate is None else f"{rate:.1f}")
    groups = _table("consumer groups", "tier", "group", "input", "committed", "lag")
    for g in snapshot.groups:
        groups.add_row(
            g.tier, g.group_id, g.topic or "(no group input)",
            g.error or ("-" if g.committed is None else str(g.committed)), "-" if g.lag is None else str(g.lag),
        )
    usage = snapshot.usage
    used = usage.get("admitted", 0) - usage.get("dropped", 0)
    budget = _table("trainer version and staleness budget",
                    "version", "admitted", "emitted", "dropped", "in flight", "capacity", "used", "drops by reason")
    drops = ", ".join(f"{reason}={count}" for reason, count in sorted(snapshot.drops.items())) or "-"
    capacity = usage.get("capacity", 0)
    emitted = "-" if snapshot.emitted is None else f"{snapshot.emitted.groups}{'' if snapshot.emitted.complete else '+'}"
    budget.add_row(
        str(usage.get("version", 0)), str(usage.get("admitted", 0)), emitted, str(usage.get("dropped", 0)),
        snapshot.in_flight(), str(capacity), f"{100 * used / capacity:.0f}%" if capacity else "-", drops,
    )
    rewards = _table(f"reward by tail version (last {REWARD_SAMPLE} scored)", "version", "mean reward", "samples")
    for version, (mean, count) in snapshot.reward_by_version.items():
        rewards.add_row(str(version), f"{mean:.4f}", str(count))
    return Group(topics, groups, budget, rewards)


def _table(title: str, *columns: str, right: tuple[str, ...] = ()) -> Table:
    """A table titled on the left with these columns (those in ``right`` right-justified)."""
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left")
    return table


async def status(config: RollstreamConfig, *, once: bool, interval: float = 2.0,
                 console: Console | None = None, stop: asyncio.Event | None = None) -> Snapshot:
    """Print one snapshot (``once``) or refresh a live screen every ``interval`` seconds
    until ``stop`` is set; returns the last snapshot."""
    console = console or Console()
    async with StatusCollector(config) as collector:
        snapshot = await collector.collect()
        if once:
            console.print(render(snapshot))
            return snapshot
        with Live(render(snapshot), console=console, refresh_per_second=4) as live:
            while not (stop is not None and stop.is_set()):
                await wait_event((stop or asyncio.Event()), interval)
                snapshot = await collector.collect()
                live.update(render(snapshot))
    return snapshot

"""Prometheus metrics every tier exports (served on ``metrics.port`` when set).

Besides the tiers' own metrics, what workflows record in ``rollstream.runtime.stats.stats_tracker``
(the rollout worker runs them): ``rollstream_workflow_stat{key=...}``, a summary (``_sum`` and
``_count`` of the values recorded under a key, e.g. ``rollout/reward``; ``rate(_sum) /
rate(_count)`` is their mean over any window), and ``rollstream_workflow_count_total{key=...}``
for counters (``stats_tracker.increment``), both since the process started.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from rollstream.runtime.stats import StatsTracker, stats_tracker

log = logging.getLogger(__name__)

MESSAGES_IN = Counter("rollstream_messages_in_total", "Records consumed", ["tier", "topic"])
MESSAGES_OUT = Counter("rollstream_messages_out_total", "Records produced", ["tier", "topic"])
DEAD_LETTERS = Counter("rollstream_dead_letters_total", "Records dead-lettered", ["tier", "reason"])
EPISODES = Counter("rollstream_episodes_total", "Episodes finished", ["tier", "outcome"])
TOKENS = Counter("rollstream_generated_tokens_total", "Generated tokens", ["tier"])
REWARD = Histogram(
    "rollstream_reward", "Reward per scored episode", ["tier"],
    buckets=(-1.0, -0.5, 0.0, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0),
)
STALENESS = Histogram(
    "rollstream_staleness_versions", "Trainer version minus a group's head version", ["tier"],
    buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
)
GROUP_LATENCY = Histogram(
    "rollstream_group_completion_seconds", "First sample seen to group emitted", ["tier"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
GROUPS = Counter("rollstream_groups_total", "Groups ended, by outcome", ["tier", "outcome"])
ENGINE_LATENCY = Histogram(
    "rollstream_engine_request_seconds", "Engine generate latency", ["engine"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
OPEN_GROUPS = Gauge("rollstream_open_groups", "Groups waiting for samples", ["tier"])
WEIGHT_VERSION = Gauge("rollstream_weight_version", "Weight version in use", ["tier"])
PROMPT_CLAIMS = Counter(
    "rollstream_prompt_claims_total",
    "Prompt records read by a rollout worker, by what their claim said (run, taken: run again "
    "after its worker was gone, mine, done, held: running on another live worker)",
    ["tier", "outcome"],
)


class WorkflowStats(Collector):
    """The totals of a :class:`StatsTracker`, read at each scrape."""

    def __init__(self, tracker: StatsTracker) -> None:
        self.tracker = tracker

    def collect(self) -> Iterator[Metric]:
        sums, counts = self.tracker.totals()
        stat = SummaryMetricFamily("rollstream_workflow_stat", "Values workflows recorded, by key", labels=["key"])
        for key, (total, count) in sorted(sums.items()):
            stat.add_metric([key], count_value=count, sum_value=total)
        counter = CounterMetricFamily("rollstream_workflow_count", "Counters workflows incremented, by key",
                                      labels=["key"])
        for key, value in sorted(counts.items()):
            counter.add_metric([key], value)
        yield stat
        yield counter


WORKFLOW_STATS = WorkflowStats(stats_tracker)
REGISTRY.register(WORKFLOW_STATS)


def serve_metrics(port: int | None) -> None:
    """Serve ``/metrics`` and the health probes ``/livez`` and ``/readyz`` (``rollstream.runtime.health``)
    on ``port`` (no-op when None)."""
    from rollstream.runtime.health import serve_health  # health serves these metrics: import it lazily

    serve_health(port)

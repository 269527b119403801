"""Prometheus metrics every tier exports (served on ``metrics.port`` when set)."""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram

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


def serve_metrics(port: int | None) -> None:
    """Serve ``/metrics`` and the health probes ``/livez`` and ``/readyz`` (``rollstream.health``)
    on ``port`` (no-op when None)."""
    from rollstream.health import serve_health  # health serves these metrics: import it lazily

    serve_health(port)

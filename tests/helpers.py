"""Shared test helpers: configs that point at the session's real broker and Redis."""

from __future__ import annotations

from typing import Any

from rollstream.config import RollstreamConfig, config_from_dict


def make_config(
    kafka_bootstrap: str, redis_url: str, name: str, sections: dict[str, Any] | None = None
) -> RollstreamConfig:
    """A config for one test: its own experiment name (so its own topics and Redis keys).

    ``sections`` is merged per section over the defaults, e.g. ``{"rollout": {...}}``.
    """
    tree: dict[str, Any] = {
        "kafka": {"bootstrap_servers": kafka_bootstrap, "partitions": 2, "transaction_timeout_ms": 15000},
        "redis": {"url": redis_url},
        "experiment": {"experiment_name": name, "trial_name": "t0"},
    }
    for section, values in (sections or {}).items():
        if isinstance(values, dict):
            tree.setdefault(section, {}).update(values)
        else:
            tree[section] = values
    return config_from_dict(tree)

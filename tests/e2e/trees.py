"""The one config builder of the end-to-end tests: every tier on the session's broker and Redis,
the HF engine on a tiny model, settings for a quick recovery (short session and transaction
timeouts), stable ids; each test sets what it is about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rollstream.config import RollstreamConfig, config_from_dict


def pipeline_tree(
    name: str, kafka: str, redis_url: str, model: Path, *, trial: str, step_groups: int, eta: int,
    **sections: dict[str, Any],
) -> dict[str, Any]:
    """The tree; ``sections`` are merged key by key over each section's defaults (a section
    not named here, e.g. ``producer``, is taken as given)."""
    tree: dict[str, Any] = {
        "kafka": {"bootstrap_servers": kafka, "partitions": 2, "transaction_timeout_ms": 15000},
        "redis": {"url": redis_url},
        "experiment": {"experiment_name": name, "trial_name": trial},
        "staleness": {"max_head_offpolicyness": eta, "batch_size": step_groups},
        "rollout": {"model_path": str(model), "seed": 0, "worker_id": f"rw-{trial}", "commit_interval_seconds": 0.2,
                    "shutdown_grace_seconds": 20},
        "reward": {"tokenizer_path": str(model), "worker_id": f"rew-{trial}", "max_workers": 1,
                   "session_timeout_ms": 6000},
        "grouping": {"instance_id": f"g-{trial}", "commit_interval_ms": 50, "session_timeout_ms": 6000},
        "trainer": {"group_id": f"{name}-trainer"},
    }
    for section, values in sections.items():
        tree[section] = {**tree.get(section, {}), **values}
    return tree


def write_tree(path: Path, tree: dict[str, Any]) -> tuple[Path, RollstreamConfig]:
    """``tree`` written as the tiers' YAML config file, and the config it is."""
    path.write_text(yaml.safe_dump(tree))
    return path, config_from_dict(tree)

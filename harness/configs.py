"""The one config builder of the tests and the benchmarks (:func:`pipeline_config`), the config
of one test parsed (:func:`make_config`), and a config file for tier processes
(:func:`write_config`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rollstream.config import RollstreamConfig, config_from_dict


def pipeline_config(kafka_bootstrap: str, redis_url: str, name: str, model: Path | None = None,
                    dataset: Path | None = None, prompts: int | None = None, *, trial: str = "t0",
                    **sections: Any) -> dict[str, Any]:
    """A config tree: every tier on one broker (2 partitions a topic) and one Redis, in the
    experiment ``name`` (topics and Redis keys of its own).

    With ``model``: the tiers of a whole pipeline on the HF engine with ``model``, settings for a
    quick recovery (short transaction and session timeouts), stable ids, a trainer group of the
    experiment's own (the fault and end-to-end tests, ``bench.chaos``). With ``dataset``: a
    producer of it that stops after ``prompts`` (None: when stopped). ``sections`` are merged key
    by key over each section's defaults; a value that is not a dict (``log_level``) is set."""
    tree: dict[str, Any] = {
        "kafka": {"bootstrap_servers": kafka_bootstrap, "partitions": 2},
        "redis": {"url": redis_url},
        "experiment": {"experiment_name": name, "trial_name": trial},
    }
    if model is not None:
        _merge(tree, {
            "kafka": {"transaction_timeout_ms": 10000},
            "staleness": {"groups_per_step": 8, "max_head_offpolicyness": 1},
            "rollout": {"engine": "hf", "model_path": str(model), "seed": 0, "max_concurrent_rollouts": 16,
                        "gconfig": {"max_new_tokens": 4}, "worker_id": "rollout-0",
                        "commit_interval_seconds": 0.5, "shutdown_grace_seconds": 10},
            "reward": {"worker_id": "reward-0", "tokenizer_path": str(model), "max_workers": 1,
                       "timeout_seconds": 10, "session_timeout_ms": 6000, "poll_timeout_ms": 200},
            "grouping": {"instance_id": "grouping-0", "session_timeout_ms": 6000, "commit_interval_ms": 200},
            "trainer": {"group_id": f"{name}-trainer"},
        })
    if dataset is not None:
        producer: dict[str, Any] = {"dataset": str(dataset), "group_size": 4, "producer_id": "producer-0",
                                    "max_prompts": prompts, "max_batch_prompts": 8, "admission_poll_seconds": 0.5}
        if prompts is None:
            del producer["max_prompts"]
        tree["producer"] = producer
    _merge(tree, sections)
    return tree


def make_config(kafka_bootstrap: str, redis_url: str, name: str,
                sections: dict[str, Any] | None = None) -> RollstreamConfig:
    """The parsed :func:`pipeline_config` of one test run in this process (transactions may take
    15 s), ``sections`` merged per section over the defaults, e.g. ``{"rollout": {...}}``."""
    sections = dict(sections or {})
    sections["kafka"] = {"transaction_timeout_ms": 15000, **sections.get("kafka", {})}
    return config_from_dict(pipeline_config(kafka_bootstrap, redis_url, name, **sections))


def write_config(path: Path, tree: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def _merge(tree: dict[str, Any], sections: dict[str, Any]) -> None:
    for section, values in sections.items():
        if isinstance(values, dict):
            tree[section] = {**tree.get(section, {}), **values}
        else:
            tree[section] = values

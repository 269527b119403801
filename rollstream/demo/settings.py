"""The demo's knobs and the one config file every demo process reads.

:class:`DemoSettings` holds what a user may want to change (steps, workers, the GRPO
hyperparameters); :func:`demo_config_tree` turns it into a ``RollstreamConfig`` tree for
the tiers and the trainer, which :func:`write_config` validates and saves as YAML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rollstream.config import ServerLaunchConfig, config_from_dict

REWARD_FN = "rollstream.demo.task:digit_answer_reward"


@dataclass(frozen=True)
class DemoSettings:
    """Defaults tuned so that the reward rises within a few minutes on 2 CPU cores."""

    steps: int = 50
    workers: int = 1
    trainer_ranks: int = 1  # > 1: the example trainer under torchrun (gloo, CPU), DDP across the ranks
    trainer_restarts: int = 3  # torchrun starts a failed trainer again this often (trainer.max_restarts)
    group_size: int = 8  # samples per prompt
    prompts_per_step: int = 8  # groups per trainer step (staleness.groups_per_step)
    max_operand: int = 3  # a, b in 0..max_operand: few enough problems to learn in minutes
    learning_rate: float = 1e-3
    ppo_epochs: int = 2
    clip: float = 0.2
    max_new_tokens: int = 4
    temperature: float = 1.0
    max_head_offpolicyness: int = 1  # eta
    warmup_steps: int = 600  # supervised warm-up before version 0 (fewer: less reliable learning)
    hidden_size: int = 64
    num_layers: int = 2
    partitions: int = 2
    max_concurrent_rollouts: int = 16
    seed: int = 0
    device: str = "cpu"  # where the rollout workers' HF engine and the trainer run (rollout.device, trainer.device)
    engine: str = "hf"  # "vllm": the rollout workers generate on a local vLLM server (rollstream.dev.vllm_server)
    # "distributed": the trainer sends each version to the vLLM server over gloo (engine vllm),
    # a checkpoint every checkpoint_every versions
    weight_transfer: str = "checkpoint"
    checkpoint_every: int = 5
    # engine vllm: the server's rollout.launch settings beyond the demo's (e.g. dtype: bfloat16)
    launch: dict[str, Any] = field(default_factory=dict)

    def dataset_size(self) -> int:
        """Prompts the producer may publish: the steps' worth plus what staleness lets run ahead."""
        return (self.steps + self.max_head_offpolicyness + 2) * self.prompts_per_step


def demo_config_tree(
    settings: DemoSettings,
    *,
    kafka_bootstrap: str,
    redis_url: str,
    experiment: str,
    run_dir: Path,
    model_dir: Path,
    dataset: Path,
    server_urls: list[str] | None = None,
) -> dict[str, Any]:
    """The config shared by every demo process (rollout workers get their id with ``--set``);
    with ``server_urls``, the rollout workers generate on those vLLM servers."""
    gconfig = {"max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature}
    rollout: dict[str, Any] = {
        "engine": "hf", "model_path": str(model_dir), "device": settings.device, "seed": settings.seed,
        "gconfig": gconfig, "max_concurrent_rollouts": settings.max_concurrent_rollouts,
        "fileroot": str(run_dir / "dumps"), "shutdown_grace_seconds": 5.0,
    }
    if server_urls:
        rollout.update(engine="vllm", server_urls=list(server_urls), weight_transfer=settings.weight_transfer,
                       launch=dict(settings.launch))
    return {
        "kafka": {"bootstrap_servers": kafka_bootstrap, "partitions": settings.partitions,
                  "transaction_timeout_ms": 15000},
        "redis": {"url": redis_url},
        "experiment": {"experiment_name": experiment, "trial_name": "t0"},
        "staleness": {"max_head_offpolicyness": settings.max_head_offpolicyness,
                      "groups_per_step": settings.prompts_per_step},
        "producer": {"dataset": str(dataset), "group_size": settings.group_size, "seed": settings.seed,
                     "producer_id": "demo-producer", "max_batch_prompts": settings.prompts_per_step},
        "rollout": rollout,
        "reward": {"reward_fn": REWARD_FN, "tokenizer_path": str(model_dir), "max_workers": 1,
                   "worker_id": "demo-reward-0"},
        "grouping": {"instance_id": "demo-grouping-0"},
        "trainer": {"checkpoint_dir": str(run_dir / "ckpt"),
                    "group_id": f"{experiment}-trainer",
                    "model_path": str(model_dir), "device": settings.device, "learning_rate": settings.learning_rate,
                    "clip": settings.clip, "ppo_epochs": settings.ppo_epochs, "max_steps": settings.steps,
                    "max_restarts": settings.trainer_restarts, "checkpoint_every": settings.checkpoint_every},
    }


def write_config(tree: dict[str, Any], path: Path) -> Path:
    """Validate ``tree`` (``ConfigError`` naming the bad key) and write it as YAML."""
    config_from_dict(tree)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def demo_launch(settings: DemoSettings) -> ServerLaunchConfig:
    """The demo's vLLM server settings: ``rollout.launch`` with ``settings.launch`` over its
    defaults; ``ConfigError`` naming a bad key."""
    return config_from_dict({"rollout": {"launch": dict(settings.launch)}}).rollout.launch

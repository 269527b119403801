"""A reference GRPO trainer against the ``batches`` topic: copy it to write your own.

    python examples/grpo_trainer.py --config my.yaml      # or: rollstream train --config my.yaml

Each step:

1. read ``trainer.batch_size`` groups with :class:`BatchConsumer` (read_committed);
2. group-normalised advantages ``(r - mean_group) / (std_group + eps)``;
3. ``trainer.ppo_epochs`` AdamW steps of the PPO-clip loss (ratio against the behaviour
   logprobs the rollout workers recorded, clip ``trainer.clip``) over ``loss_mask`` tokens;
4. ``ack`` the batch (its offsets are committed only now: a trainer that dies before this
   gets the same groups again);
5. save the weights to ``<trainer.checkpoint_dir>/v<n>`` and publish version ``n`` with
   :class:`VersionPublisher`; the rollout workers load them and tag new tokens with ``n``.

Staleness is reported from the per-token versions (trainer version minus token version over
generated tokens). A restarted trainer continues from the version in Redis (its weights are
loaded from the published path; the optimizer state starts afresh).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples` and the tiers importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from consumers.batch_consumer import BatchConsumer, TrainingBatch, VersionPublisher
from examples.grpo import Staleness, UpdateStats, group_advantages, policy_update, staleness_stats
from rollstream.config import ConfigError, RollstreamConfig, raise_first_problem
from rollstream.metrics import STALENESS, WEIGHT_VERSION
from rollstream.redis_state import RedisKeys, VersionStore, connect

log = logging.getLogger(__name__)

TIER = "trainer"
POLL_SECONDS = 1.0


@dataclass(frozen=True)
class StepReport:
    """One finished trainer step; ``version`` is the version published after it."""

    step: int
    version: int
    reward_mean: float
    episodes: int
    groups: int
    update: UpdateStats
    staleness: Staleness
    head_version: int
    tail_version: int
    seconds: float  # wall time of the step, waiting for the batch included
    finished_at: float  # time.monotonic()


StepCallback = Callable[[StepReport], None]


def check_config(config: RollstreamConfig) -> None:
    tc = config.trainer
    problems = [
        (not tc.model_path, "trainer.model_path must name the initial weights (version 0)"),
        (tc.learning_rate <= 0, "trainer.learning_rate must be > 0"),
        (tc.clip <= 0, "trainer.clip must be > 0"),
        (tc.ppo_epochs < 1, "trainer.ppo_epochs must be >= 1"),
        (tc.max_steps < 0, "trainer.max_steps must be >= 0"),
        (tc.keep_checkpoints < 1, "trainer.keep_checkpoints must be >= 1"),
    ]
    raise_first_problem(problems)


class GRPOTrainer:
    """The model, its optimizer and the step logic; :meth:`run` is the loop over batches."""

    def __init__(self, config: RollstreamConfig) -> None:
        check_config(config)
        from transformers import AutoModelForCausalLM

        self.config = config
        tc = config.trainer
        self.model = AutoModelForCausalLM.from_pretrained(tc.model_path).to(tc.device).eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=tc.learning_rate)
        # The behaviour logprobs were taken at the rollout temperature: use the same one.
        self.temperature = float(config.rollout.gconfig.get("temperature", 1.0))
        self.version = 0
        self.checkpoints = Path(tc.checkpoint_dir)

    def train_on(self, batch: TrainingBatch) -> tuple[UpdateStats, Staleness, float]:
        """One policy update on ``batch``: ``(update stats, staleness, mean reward)``."""
        tensors = batch.tensors
        rewards = tensors["rewards"].to(torch.float32)
        advantages = group_advantages(rewards, batch.row_task)
        tc = self.config.trainer
        update = policy_update(
            self.model, self.optimizer, tensors, advantages, temperature=self.temperature,
            clip=tc.clip, epochs=tc.ppo_epochs, max_grad_norm=tc.max_grad_norm,
        )
        staleness = staleness_stats(tensors["versions"], tensors["loss_mask"], self.version)
        return update, staleness, float(rewards.mean().item())

    def save(self, version: int) -> Path:
        """Write ``v<version>`` (safetensors + config) and delete checkpoints beyond the kept ones."""
        path = self.checkpoints / f"v{version}"
        tmp = self.checkpoints / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp, safe_serialization=True)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)  # a reader never sees a half-written checkpoint
        old = self.checkpoints / f"v{version - self.config.trainer.keep_checkpoints}"
        if version - self.config.trainer.keep_checkpoints > 0:
            shutil.rmtree(old, ignore_errors=True)
        return path

    async def resume(self) -> None:
        """Continue from the version in Redis, if a trainer already published one."""
        exp = self.config.experiment
        redis = connect(self.config.redis)
        try:
            update = await VersionStore(redis, RedisKeys(exp.experiment_name, exp.trial_name)).get_update()
        finally:
            await redis.aclose()
        if update is None or update.version <= 0:
            return
        from transformers import AutoModelForCausalLM

        loaded = await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, update.path)
        self.model.load_state_dict(loaded.state_dict())
        self.version = update.version
        log.info("resuming from published version %d (%s)", update.version, update.path)

    async def run(self, stop: asyncio.Event, on_step: StepCallback | None = None) -> list[StepReport]:
        """Train until ``stop`` is set or ``trainer.max_steps`` steps are done."""
        await self.resume()
        reports: list[StepReport] = []
        max_steps = self.config.trainer.max_steps
        async with contextlib.AsyncExitStack() as stack:
            batches = await stack.enter_async_context(BatchConsumer(self.config))
            versions = await stack.enter_async_context(VersionPublisher(self.config))
            started = time.monotonic()
            while not stop.is_set() and (max_steps == 0 or len(reports) < max_steps):
                batch = await batches.next_batch(timeout=POLL_SECONDS)
                if batch is None:
                    continue
                report = await self._step(batch, batches, versions, len(reports) + 1, started)
                reports.append(report)
                started = report.finished_at
                if on_step is not None:
                    on_step(report)
        return reports

    async def _step(self, batch: TrainingBatch, batches: BatchConsumer, versions: VersionPublisher,
                    step: int, started: float) -> StepReport:
        # The update runs in a thread so that the event loop (Kafka heartbeats) keeps going.
        update, staleness, reward = await asyncio.to_thread(self.train_on, batch)
        await batches.ack(batch)
        path = await asyncio.to_thread(self.save, self.version + 1)
        self.version += 1
        await versions.publish(self.version, str(path.resolve()))
        WEIGHT_VERSION.labels(TIER).set(self.version)
        STALENESS.labels(TIER).observe(batch.max_staleness)
        now = time.monotonic()
        report = StepReport(
            step=step, version=self.version, reward_mean=reward, episodes=int(batch.tensors["rewards"].numel()),
            groups=batch.num_groups, update=update, staleness=staleness, head_version=batch.head_version,
            tail_version=batch.tail_version, seconds=now - started, finished_at=now,
        )
        log.info(
            "step %d: version %d, reward %.3f over %d episodes, loss %.4f, clip %.2f, staleness mean %.2f max %d",
            step, self.version, reward, report.episodes, update.loss.loss, update.loss.clip_fraction,
            staleness.mean, staleness.max,
        )
        return report


async def run(config: RollstreamConfig, stop: asyncio.Event) -> None:
    """The tier-style entry point (``rollstream train``): train until stopped or max_steps."""
    trainer = await asyncio.to_thread(GRPOTrainer, config)
    await trainer.run(stop)


def main(argv: list[str] | None = None) -> int:
    from rollstream.cli import add_config_arguments, run_tier
    from rollstream.config import load_config

    parser = argparse.ArgumentParser(description="GRPO trainer reading the batches topic")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        check_config(config)
    except ConfigError as exc:
        print(f"grpo_trainer: {exc}", file=sys.stderr)
        return 2
    return run_tier(TIER, run, config)


if __name__ == "__main__":
    sys.exit(main())

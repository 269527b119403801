"""A reference GRPO trainer on ``rollstream.trainer``: copy it to write your own.

    python examples/grpo_trainer.py --config my.yaml                          # one process
    torchrun --nproc-per-node 2 examples/grpo_trainer.py --config my.yaml     # two ranks (DDP)
    rollstream train --config my.yaml [--ranks 2] [--max-restarts 3]          # the same, restarted on failure

Under ``torchrun`` every rank runs this file: the model is wrapped in DistributedDataParallel
(gloo on CPU, NCCL with ``trainer.device: cuda``, one GPU per rank) and
:class:`~rollstream.trainer.TrainerSteps` gives each rank its share of every step. Each step:

1. this rank's share of ``staleness.groups_per_step`` groups (whole groups, balanced by tokens);
2. group-normalised advantages ``(r - mean_group) / (std_group + eps)``;
3. ``trainer.ppo_epochs`` AdamW updates of the PPO-clip loss (ratio against the behaviour
   logprobs the rollout workers recorded, clip ``trainer.clip``) over ``loss_mask`` tokens,
   gradients averaged across ranks by DDP;
4. rank 0 saves the weights as checkpoint ``v<step>`` (complete or invisible:
   :class:`~rollstream.trainer.Checkpoints`), with the step's figures (:class:`StepRecord`);
   with ``rollout.weight_transfer: distributed`` only every ``trainer.checkpoint_every`` steps;
5. every rank commits the step (rank 0 writes the ledger and commits the offsets, once);
6. rank 0 appends the step's line to ``--steps-file`` and publishes version ``<step>``
   (versions only go up; old checkpoints and their Redis entries are deleted together,
   keeping ``trainer.keep_checkpoints``); with ``distributed`` it publishes with the model in
   hand, and the publish sends the weights to every inference server before it returns.

Restart (after a crash, a stall or a failure of any rank; ``rollstream train`` runs the job
under ``torchrun --max-restarts``): the job resumes after the last committed step, from that
step's checkpoint (with ``distributed``: from the newest checkpoint at or before it; the steps
after it were trained and committed, but their weights are lost with the process: the price
of ``trainer.checkpoint_every`` above 1). A checkpoint written for a step whose commit did not happen is discarded;
that step number is trained again on the groups that follow the committed offsets, which
need not be the groups the lost step held (the order across partitions may differ): none is
lost and none is trained twice (docs/TRAINER.md). A crash after the commit leaves the step's
steps-file line or its publish undone: the restarted rank 0 does both from the checkpoint.
The optimizer state starts afresh.

``--steps-file F``: rank 0 appends one JSON line per committed step, each step once (the
figures of :class:`StepRecord`), which ``rollstream demo`` follows.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rollstream.trainer.grpo import Staleness, UpdateStats, group_advantages, policy_update, staleness_stats
from rollstream.config import ConfigError, RollstreamConfig, require
from rollstream.demo.report import StepRecord, StepsLog  # one step's figures: the --steps-file lines the demo reads
from rollstream.runtime.health import heartbeat_thread, mark_ready
from rollstream.runtime.metrics import STALENESS, WEIGHT_VERSION, serve_metrics
from rollstream.trainer import Checkpoint, Checkpoints, SyncVersionPublisher, TrainerSteps, TrainingStep

log = logging.getLogger(__name__)

TIER = "trainer"


def check_config(config: RollstreamConfig) -> None:
    """What this trainer needs beyond the schema's rules (which the types carry)."""
    require(config.trainer.model_path, "trainer.model_path", "must name the initial weights (version 0)")


def init_distributed(device: str) -> tuple[int, int, str]:
    """``(rank, world_size, device)``; starts the process group under ``torchrun``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        cuda = device.startswith("cuda")
        if cuda:  # one GPU per rank
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            device = f"cuda:{local}"
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, device


class GRPOTrainer:
    """The model, its optimizer and the step; :meth:`run` is the loop over this rank's steps."""

    def __init__(self, config: RollstreamConfig, steps_file: Path | None = None) -> None:
        check_config(config)
        self.config = config
        tc = config.trainer
        self.rank, self.world, self.device = init_distributed(tc.device)
        self.leader = self.rank == 0
        self.checkpoints = Checkpoints(tc.checkpoint_dir)
        self.steps_log = StepsLog(steps_file) if steps_file is not None else None
        # The behaviour logprobs were taken at the rollout temperature: use the same one.
        self.temperature = float(config.rollout.gconfig.get("temperature", 1.0))
        self.version = 0
        self.model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.stopping = False
        # rollout.weight_transfer distributed: each version goes to the servers from the model in
        # hand; a checkpoint only every trainer.checkpoint_every steps
        self.over_the_wire = config.rollout.weight_transfer == "distributed"
        self.checkpoint_every = tc.checkpoint_every if self.over_the_wire else 1

    # -- resume --

    def resume(self, last_step: int, versions: SyncVersionPublisher | None) -> None:
        """Load the checkpoint of the last committed step (the initial weights when none)."""
        if self.leader:
            self.checkpoints.remove_partials()
            self.checkpoints.discard_after(last_step)  # written, never committed: trained again
        if dist.is_initialized():
            dist.barrier()  # nobody reads the directory while rank 0 tidies it up
        checkpoint = self.checkpoints.latest(at_most_step=last_step)
        if last_step > 0 and (checkpoint is None or checkpoint.step != last_step) and not self.over_the_wire:
            raise RuntimeError(
                f"the ledger says step {last_step} was committed but {self.checkpoints.directory} has no "
                f"checkpoint of it (found {checkpoint}): restore the checkpoint directory"
            )
        path = checkpoint.path if checkpoint is not None else Path(self.config.trainer.model_path)
        if checkpoint is not None and checkpoint.step != last_step:
            log.warning("resuming from step %d's checkpoint: the weights of steps %d-%d (committed, sent over the "
                        "wire, never checkpointed: trainer.checkpoint_every) are lost with the process",
                        checkpoint.step, checkpoint.step + 1, last_step)
        self._load(path)
        self.version = last_step if self.over_the_wire else (checkpoint.version if checkpoint is not None else 0)
        if self.leader and checkpoint is not None:
            self._write_step_line_if_missing(checkpoint)
        if versions is not None:
            self._publish_if_behind(checkpoint, last_step, versions)
        log.info("rank %d: starting after step %d from %s", self.rank, last_step, path)

    def _write_step_line_if_missing(self, checkpoint: Checkpoint) -> None:
        """The crash came between the commit of the checkpoint's step and its steps-file line:
        write the line from the record saved with the checkpoint."""
        if self.steps_log is None or checkpoint.step in self.steps_log.steps():
            return
        record = checkpoint.meta.get("record")
        if record is None:
            log.warning("step %d has no line in %s and its checkpoint no record of it (written by an older "
                        "trainer): the steps file lacks it", checkpoint.step, self.steps_log.path)
            return
        self.steps_log.append(StepRecord(**record))
        log.info("step %d: its line was missing from %s (a restart after its commit); written from its checkpoint",
                 checkpoint.step, self.steps_log.path)

    def _publish_if_behind(self, checkpoint: Checkpoint | None, last_step: int, versions: SyncVersionPublisher) -> None:
        current, mine = versions.current_version(), checkpoint.version if checkpoint is not None else 0
        if checkpoint is not None and current < mine and not self.over_the_wire:  # a crash between commit and publish
            versions.publish(mine, checkpoint)
        elif current > max(mine, last_step if self.over_the_wire else mine):
            raise RuntimeError(
                f"redis holds version {current}, above this trainer's last committed step {mine}: another "
                "trainer publishes to this experiment, or its ledger or checkpoints were replaced"
            )

    def _load(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path).to(self.device).eval()
        if self.world > 1:
            devices = [torch.device(self.device).index] if self.device.startswith("cuda") else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=devices)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=self.config.trainer.learning_rate)

    # -- the step --

    def train_on(self, step: TrainingStep) -> tuple[UpdateStats, Staleness, float]:
        """One policy update on this rank's share: ``(update stats, staleness, reward sum)``."""
        assert self.optimizer is not None
        tensors = step.tensors
        rewards = tensors["rewards"].to(torch.float32)
        advantages = group_advantages(rewards, step.row_task)
        tc = self.config.trainer
        update = policy_update(
            self.model, self.optimizer, tensors, advantages, temperature=self.temperature,
            clip=tc.clip, epochs=tc.ppo_epochs, max_grad_norm=tc.max_grad_norm,
        )
        staleness = staleness_stats(tensors["versions"], tensors["loss_mask"], self.version)
        return update, staleness, float(rewards.sum().item())

    def save(self, step: int, record: StepRecord) -> Checkpoint:
        """Rank 0: checkpoint ``v<step>`` (safetensors + config, and the step's ``record``),
        complete or absent."""
        model = self.model.module if self.world > 1 else self.model
        with self.checkpoints.write(step, step=step, meta={"record": asdict(record)}) as out:
            model.save_pretrained(out, safe_serialization=True)
        checkpoint = self.checkpoints.get(step)
        assert checkpoint is not None
        return checkpoint

    def _totals(self, step: TrainingStep, reward_sum: float, staleness: Staleness) -> tuple[float, int, float, int]:
        """Reward mean, episodes, staleness mean and max over every rank's share."""
        rows = float(step.tensors["rewards"].numel())
        local = torch.tensor([reward_sum, rows, staleness.mean * staleness.tokens, float(staleness.tokens),
                              float(staleness.max)], dtype=torch.float64, device=self.device)
        if self.world > 1:
            high = local[4:].clone()
            dist.all_reduce(local, op=dist.ReduceOp.SUM)
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            local[4] = high[0]
        reward, n, stale_sum, stale_n, stale_max = local.tolist()
        return reward / max(n, 1.0), int(n), stale_sum / stale_n if stale_n else 0.0, int(stale_max)

    def run(self) -> list[StepRecord]:
        """Train until stopped (SIGTERM / Ctrl-C) or ``trainer.max_steps`` steps are committed."""
        reports: list[StepRecord] = []
        max_steps = self.config.trainer.max_steps
        versions = SyncVersionPublisher(self.config, self.checkpoints) if self.leader else None
        try:
            published = (lambda: versions.last_published) if versions is not None else None
            with TrainerSteps(self.config, published=published) as steps:
                self._on_signals(steps)
                self.resume(steps.last_committed_step, versions)
                mark_ready()  # /readyz: consuming batches
                if max_steps and steps.last_committed_step >= max_steps:
                    return reports  # done before the restart
                started = time.monotonic()
                for step in steps:
                    if max_steps and step.step > max_steps:
                        break
                    report = self._step(step, steps, versions, started)
                    reports.append(report)
                    started = time.monotonic()
                    if max_steps and step.step >= max_steps:
                        break
        finally:
            if versions is not None:
                versions.close()
        return reports

    def _step(self, step: TrainingStep, steps: TrainerSteps, versions: SyncVersionPublisher | None,
              started: float) -> StepRecord:
        update, staleness, reward_sum = self.train_on(step)
        reward, episodes, stale_mean, stale_max = self._totals(step, reward_sum, staleness)
        report = StepRecord(
            step=step.step, version=step.step, reward_mean=reward, episodes=episodes, groups=step.step_groups,
            ranks=self.world, loss=update.loss.loss, clip_fraction=update.loss.clip_fraction,
            approx_kl=update.loss.approx_kl, grad_norm=update.grad_norm, staleness_mean=stale_mean,
            staleness_max=stale_max, head_version=step.head_version, tail_version=step.tail_version,
            seconds=time.monotonic() - started, finished_at=time.time(),
        )
        checkpoint = None
        if self.leader and step.step % self.checkpoint_every == 0:
            steps.phase("checkpoint")
            checkpoint = self.save(step.step, report)  # durable before the commit, with its record
        steps.commit(step)  # every rank finished the step; it is never delivered again
        self.version = step.step
        if self.leader:
            log.info("step %d: version %d, reward %.3f over %d episodes on %d ranks, loss %.4f, clip %.2f, "
                     "staleness mean %.2f max %d", report.step, report.version, reward, episodes, self.world,
                     report.loss, report.clip_fraction, stale_mean, stale_max)
            if self.steps_log is not None:
                steps.phase("steps file")
                self.steps_log.append(report)
        if versions is not None:
            steps.phase("publish")
            versions.publish(step.step, checkpoint, model=self.model if self.over_the_wire else None)
        WEIGHT_VERSION.labels(TIER).set(self.version)
        STALENESS.labels(TIER).observe(step.max_staleness)
        return report

    def _on_signals(self, steps: TrainerSteps) -> None:
        """SIGTERM / SIGINT: finish the current step, then stop every rank (a second one: exit now).
        A rank that is ending because another rank was lost (its heartbeats said so) has no step
        to finish: the signal changes nothing and says nothing."""
        def stop(signum: int, frame: Any) -> None:
            if steps.peer_lost:
                return
            if self.stopping:
                raise KeyboardInterrupt
            self.stopping = True
            log.info("stop requested (%s): every rank finishes its current step, then stops", signal.Signals(signum).name)
            steps.stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)


def exit_with_launcher() -> None:
    """Under torchrun: leave when the launcher is gone. Its workers run in sessions of their own,
    so a launcher killed with SIGKILL (after its grace period) would leave them running."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(2.0)
        log.error("torchrun is gone; exiting")
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    from rollstream.cli import add_config_arguments
    from rollstream.config import load_config
    from rollstream.runtime.logs import setup_logging

    parser = argparse.ArgumentParser(description="GRPO trainer reading the batches topic (torchrun-ready)")
    add_config_arguments(parser)
    parser.add_argument("--steps-file", type=Path, default=None, help="rank 0 appends one JSON line per step here")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        check_config(config)
    except ConfigError as exc:
        print(f"grpo_trainer: {exc}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(TIER if rank == 0 else f"{TIER}-rank{rank}", config.log_level)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_launcher()
    if rank == 0:  # /metrics, /livez and /readyz on metrics.port: Prometheus and compose's health check
        serve_metrics(config.metrics.port)
        heartbeat_thread()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no progress bars between the log lines
    try:
        GRPOTrainer(config, args.steps_file).run()
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.exception("trainer failed")
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

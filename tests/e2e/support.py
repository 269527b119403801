"""What the end-to-end tests share: a tier as a child process, reading a topic whole, the
budget watch, and the checks of what a trainer receives (tensors, logprobs per version)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rollstream.state.budget import StalenessBudget
from rollstream.trainer import TrainingBatch
from rollstream.vision.forward import trajectory_logits


class Tier:
    """One tier as a child process, logging to a file in the test's directory."""

    def __init__(self, name: str, config: Path, logdir: Path) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
        env.pop("REDIS_URL", None)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollstream.cli", name.split("#")[0], "--config", str(config)],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} did not stop on SIGTERM; log tail:\n{self.tail()}") from None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def tails(tiers: dict[str, Tier]) -> str:
    return "\n".join(f"--- {name}\n{tier.tail()}" for name, tier in tiers.items())


async def watch_budget(budget: StalenessBudget, violations: list[dict[str, int]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        usage = await budget.usage()
        if usage["admitted"] - usage["dropped"] > usage["capacity"]:
            violations.append(usage)
        await asyncio.sleep(0.1)


def check_batch_tensors(batch: TrainingBatch, step_groups: int) -> None:
    t = batch.tensors
    n, length = t["input_ids"].shape
    assert n == sum(batch.group_sizes) and len(batch.task_ids) == step_groups
    expected = {"input_ids": torch.int32, "attention_mask": torch.bool, "loss_mask": torch.int32,
                "logprobs": torch.float32, "versions": torch.int32}
    for key, dtype in expected.items():
        assert t[key].dtype == dtype and t[key].shape == (n, length), key
    assert t["rewards"].dtype == torch.float32 and t["rewards"].shape == (n,)
    generated = t["loss_mask"].bool()
    assert not (generated & ~t["attention_mask"]).any()
    assert (t["versions"][~generated] == -1).all(), "prompt and pad positions carry version -1"
    assert (t["versions"][generated] >= 0).all()
    assert (t["logprobs"][~generated] == 0).all()
    assert generated.any(dim=1).all(), "every row generated something"


def check_logprobs(batches: list[TrainingBatch], weights: list[Path]) -> int:
    """Recompute every generated token's logprob with the weights of its version."""
    models: dict[int, Any] = {}
    checked = 0
    for batch in batches:
        t = batch.tensors
        for row in range(t["input_ids"].shape[0]):
            seqlen = int(t["attention_mask"][row].sum())
            ids = t["input_ids"][row, :seqlen].long()
            versions = t["versions"][row, :seqlen]
            for version in sorted({int(v) for v in versions.tolist() if v >= 0}):
                model = models.get(version) or models.setdefault(
                    version, AutoModelForCausalLM.from_pretrained(weights[version]).eval())
                with torch.no_grad():
                    logits = model(ids.unsqueeze(0)).logits[0].float()
                expected = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None]).squeeze(1)
                positions = (versions[1:] == version).nonzero().squeeze(1)
                got = t["logprobs"][row, 1:seqlen][positions]
                torch.testing.assert_close(got, expected[positions], atol=1e-4, rtol=0)
                checked += len(positions)
    return checked


def save_versions(base: Path, out: Path, versions: int) -> list[Path]:
    """Version 0 is the built model; version v > 0 is a perturbed copy (distinct weights)."""
    paths = [base]
    model = AutoModelForCausalLM.from_pretrained(base)
    for version in range(1, versions + 1):
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.02)
        path = out / f"v{version}"
        model.save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (base / name).exists():
                (path / name).write_bytes((base / name).read_bytes())
        paths.append(path)
    return paths


def check_vision_logprobs(batches: list[TrainingBatch], model_dir: Path, images_of: dict[str, list[bytes]]) -> int:
    """Every row gets its prompt's images; a fresh pass with them reproduces its logprobs."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    checked = 0
    for batch in batches:
        vision = batch.vision
        assert vision is not None
        for row, group in enumerate(batch.row_task):
            shown = [batch.group_images[group][i] for i in batch.row_images[row]]
            assert shown == images_of[batch.task_ids[group]], "the row shows its prompt's images, in order"
            assert len(vision.row_images[row]) == len(shown)
        with torch.no_grad():
            logits = trajectory_logits(model, batch.tensors, vision).float()
        t = batch.tensors
        expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, t["input_ids"][:, 1:].long().unsqueeze(-1)).squeeze(-1)
        generated = t["loss_mask"][:, 1:].bool()
        torch.testing.assert_close(t["logprobs"][:, 1:][generated], expected[generated], atol=1e-4, rtol=0)
        checked += int(generated.sum())
    return checked

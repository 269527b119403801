"""What the end-to-end tests share: the tiers as child processes, the staleness budget's watch,
and the checks of what a trainer receives (tensors, logprobs per version)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from bench.stack import TierProcess
from rollstream.config import RollstreamConfig
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys, connect
from rollstream.trainer import StepStream, TrainingStep
from rollstream.vision.forward import trajectory_logits


def start_tier(name: str, config: Path, logdir: Path) -> TierProcess:
    """``rollstream <tier>`` for ``name`` (``<tier>`` or ``<tier>#<n>``), logging to
    ``<logdir>/<name>.log``."""
    return TierProcess(name.split("#")[0], config, logdir / f"{name}.log", name=name).start()


@contextlib.contextmanager
def running(config: Path, logdir: Path, names: Iterable[str]) -> Iterator[dict[str, TierProcess]]:
    """The tiers ``names`` started on ``config``, by name; tiers added to the dict are kept
    too. Whatever still runs at the end is killed (with what it started)."""
    tiers = {name: start_tier(name, config, logdir) for name in names}
    try:
        yield tiers
    finally:
        for tier in tiers.values():
            tier.kill()


def check_alive(tiers: dict[str, TierProcess]) -> None:
    """Every tier runs or exited 0 (a producer whose dataset is done)."""
    assert all(t.exit_code() in (None, 0) for t in tiers.values()), tails(tiers)


def stop_cleanly(tiers: dict[str, TierProcess]) -> None:
    """The producers exit 0 on their own once their dataset is published; every other tier
    exits 0 on SIGTERM, within a minute."""
    for name, tier in tiers.items():
        if tier.tier == "producer":
            assert tier.wait(30) == 0, tier.tail()
    codes = {name: tier.stop(60) for name, tier in tiers.items() if tier.tier != "producer"}
    assert all(code == 0 for code in codes.values()), (codes, tails(tiers))


async def acked_batches(consumer: StepStream, tiers: dict[str, TierProcess], steps: int,
                        timeout: float = 300) -> AsyncIterator[TrainingStep]:
    """Each batch the trainer side reads, acked, until ``steps`` of them or ``timeout``
    seconds; while none comes, every tier must still run or have exited 0."""
    deadline = time.monotonic() + timeout
    taken = 0
    while taken < steps and time.monotonic() < deadline:
        batch = await consumer.next_step(timeout=10)
        if batch is None:
            check_alive(tiers)
            continue
        assert await consumer.ack(batch)
        taken += 1
        yield batch


def tails(tiers: dict[str, TierProcess]) -> str:
    return "\n".join(tier.tail() for tier in tiers.values())


@contextlib.asynccontextmanager
async def budget_watch(config: RollstreamConfig) -> AsyncIterator[list[dict[str, int]]]:
    """Samples the experiment's staleness budget in Redis every 0.1 s while the block runs; the
    list it yields collects each sample that held more in flight than the capacity allowed."""
    redis = connect(config.redis)
    keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
    budget = StalenessBudget(redis, keys, config.staleness.max_head_offpolicyness, config.staleness.groups_per_step)
    violations: list[dict[str, int]] = []
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            usage = await budget.usage()
            if usage["in_use"] > usage["capacity"]:
                violations.append(usage)
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    try:
        yield violations
    finally:
        stop.set()
        await watcher
        await redis.aclose()


def check_batch_tensors(batch: TrainingStep, step_groups: int) -> None:
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


def check_logprobs(batches: list[TrainingStep], weights: list[Path]) -> int:
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


def check_vision_logprobs(batches: list[TrainingStep], model_dir: Path, images_of: dict[str, list[bytes]]) -> int:
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

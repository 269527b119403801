"""Checks of what a trainer receives from a running pipeline: the batches read and acked, their
tensors, and their logprobs recomputed per version (text and vision)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from harness.tiers import TierProcess, check_alive
from rollstream.trainer import StepStream, TrainingStep
from rollstream.vision.forward import trajectory_logits


def unaccounted(consumer: StepStream, trained: int, groups: int) -> int:
    """Of ``groups`` admitted, how many the trainer side has not seen end yet: each is trained
    (``trained``), dropped (by grouping, or as stale by the trainer: ``drops_by_reason``) or
    waiting in a step that will not fill."""
    assert consumer.source is not None
    return groups - trained - sum(consumer.drops_by_reason.values()) - consumer.source.accumulator.waiting


async def acked_batches(consumer: StepStream, tiers: dict[str, TierProcess], groups: int,
                        timeout: float = 240) -> AsyncIterator[TrainingStep]:
    """Each step the trainer side reads, acked, until each of ``groups`` admitted groups is
    accounted for (:func:`unaccounted`) and no full step waits, or ``timeout`` seconds; while
    no step comes, every tier must still run or have exited 0. A group the trainer drops as
    stale (one that came late, e.g. finished by a worker's replacement after newer groups
    filled its step) is never trained: the last step may then not fill, and is waited for no
    longer."""
    deadline = time.monotonic() + timeout
    trained = 0
    assert consumer.source is not None
    accumulator = consumer.source.accumulator
    while (unaccounted(consumer, trained, groups) > 0 or accumulator.ready()) and time.monotonic() < deadline:
        batch = await consumer.next_step(timeout=10)
        if batch is None:
            check_alive(tiers)
            continue
        assert await consumer.ack(batch)
        trained += len(batch.task_ids)
        yield batch


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

"""A GRPO step on the tiny offline VLM with a trainer-side batch of rows that show images."""

from __future__ import annotations

from pathlib import Path

import torch

from harness.images import noise_png, vision_prompt
from rollstream.trainer.grpo import group_advantages, policy_update, vision_token_logprobs
from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.trajectory.rows import trajectory_row
from rollstream.vision.inputs import build_vision_inputs
from rollstream.vision.processor import load_image_processor, load_processor


def test_a_vlm_step_uses_the_images_and_starts_from_the_behaviour_logprobs(tiny_vlm_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).eval()
    processor = load_processor(tiny_vlm_dir)
    images = [[noise_png(41)], [noise_png(41)], [noise_png(42), noise_png(43, 30, 70)], []]
    rows = []
    for i, shown in enumerate(images):
        prompt = vision_prompt(processor, shown, f"What is {i}+1?")
        rows.append(trajectory_row(prompt, [20 + i, 30, 40 + i][: 2 + i % 2], [0.0] * (2 + i % 2), [0] * (2 + i % 2)))
    tensors = concat_padded_tensors(rows)  # right-padded rows of different lengths
    vision = build_vision_inputs(load_image_processor(tiny_vlm_dir), images)
    assert vision is not None and vision.num_images == 3  # the shared image is processed once
    with torch.no_grad():
        behaviour = vision_token_logprobs(model, tensors, vision) * tensors["loss_mask"]
    tensors["logprobs"] = behaviour
    tensors["rewards"] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    tower = [p.detach().clone() for p in model.model.visual.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = policy_update(model, optimizer, tensors, group_advantages(tensors["rewards"], [0, 0, 1, 1]), vision=vision)
    assert abs(stats.loss.ratio_mean - 1.0) < 1e-5 and stats.loss.approx_kl < 1e-5  # same recipe as generation
    assert stats.loss.tokens == int(tensors["loss_mask"].sum()) and stats.grad_norm > 0
    changed = [not torch.equal(before, after) for before, after in zip(tower, model.model.visual.parameters())]
    assert any(changed), "the images' features took part in the step"

"""The example trainer's GRPO step for a vision-language model: the same math as
``rollstream.trainer.grpo.policy_update``, with the images each row showed in the forward pass.

    batches = BatchStream(config)                    # trainer.processor_path: the VLM's directory
    batch = await batches.next_batch()
    advantages = group_advantages(batch.tensors["rewards"], batch.row_task)
    vision_policy_update(model, optimizer, batch.tensors, batch.vision, advantages, temperature=T)

``batch.vision`` holds the rows' ``pixel_values`` / ``image_grid_thw`` (each distinct image once),
rebuilt on the trainer side from the images the rollout's engine saw; the forward pass is
``rollstream.vision.forward.trajectory_logits``, the recipe the engine generated with, so the
first epoch's logprobs equal the batch's behaviour logprobs (for the weights that generated them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollstream.trainer.grpo import DEFAULT_CLIP, UpdateStats, ppo_epochs, token_logprobs
from rollstream.vision.forward import trajectory_logits
from rollstream.vision.inputs import VisionInputs


def vision_token_logprobs(
    model: torch.nn.Module, tensors: dict[str, Tensor], vision: VisionInputs | None, temperature: float = 1.0,
) -> Tensor:
    """``[N, L]`` logprobs of the rows' tokens (aligned like the batch's ``logprobs``) with their images."""
    logits = trajectory_logits(model, tensors, vision)
    return token_logprobs(logits, tensors["input_ids"].to(logits.device), temperature)


def vision_policy_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, Tensor],
    vision: VisionInputs | None,
    advantages: Tensor,
    *,
    temperature: float = 1.0,
    clip: float = DEFAULT_CLIP,
    epochs: int = 1,
    max_grad_norm: float | None = 1.0,
) -> UpdateStats:
    """``epochs`` optimizer steps of the PPO-clip loss on one batch with images (see
    ``rollstream.trainer.grpo.policy_update``; ``vision`` is ``TrainingBatch.vision``). The model is
    left in eval mode."""
    return ppo_epochs(model, optimizer, lambda: vision_token_logprobs(model, tensors, vision, temperature), tensors,
                      advantages, clip=clip, epochs=epochs, max_grad_norm=max_grad_norm)

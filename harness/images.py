"""Images, prompts and fresh forward passes for the vision tests (tiny VLM, built offline)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy
import torch

from rollstream.api.io_struct import ModelResponse
from rollstream.vision.forward import trajectory_logits
from rollstream.vision.images import to_base64
from rollstream.vision.inputs import build_vision_inputs


def noise_png(seed: int, height: int = 40, width: int = 60) -> bytes:
    """A random RGB image as PNG bytes (noise does not compress: the size is ~3 * h * w)."""
    from PIL import Image

    pixels = numpy.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=numpy.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def vision_prompt(processor: Any, images: Sequence[bytes], question: str = "What is 2+2?") -> list[int]:
    """Prompt ids with the image placeholders the processor makes for ``images``."""
    from rollstream.vision.images import open_image

    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    encoded = processor(images=[open_image(i) for i in images] or None, text=[text], return_tensors="pt")
    return encoded["input_ids"][0].tolist()


def image_data(images: Sequence[bytes]) -> list[str]:
    return [to_base64(i) for i in images]


def fresh_logprobs(model: Any, image_processor: Any, resp: ModelResponse, images: Sequence[bytes]) -> torch.Tensor:
    """log_softmax of the response's output tokens from one fresh forward pass with its images."""
    ids = torch.tensor([resp.input_tokens + resp.output_tokens])
    loss = torch.tensor([[0] * resp.input_len + [1] * resp.output_len])
    tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss}
    vision = build_vision_inputs(image_processor, [list(images)])
    with torch.no_grad():
        logits = trajectory_logits(model, tensors, vision)[0].float()
    positions = torch.arange(resp.input_len - 1, resp.input_len + resp.output_len - 1)
    return torch.log_softmax(logits, -1)[positions, torch.tensor(resp.output_tokens)]

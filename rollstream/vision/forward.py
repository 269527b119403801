"""Forward passes of a Qwen2-VL-style model with images: the one recipe the engine and the
trainer side share, so a trainer's fresh pass sees exactly what generation saw.

Which positions are image slots is decided here, not by the model: an image placeholder token
(``config.image_token_id``) counts only in the prompt (``placeholders``), never in generated
output. A model may sample the placeholder token like any other (a tiny random one does); the
model's own forward would then take it for an image slot and fail or misplace the images, so
the recipe builds the input embeddings itself: token embeddings, with the vision tower's
features scattered into the placeholder positions, and multimodal rotary positions (M-RoPE)
from ``model.model.get_rope_index``. Supported: models with ``model.model.get_image_features``
and ``get_rope_index`` (transformers' Qwen2-VL family).

Callers may rely on: the number of placeholders must equal the image tokens the images make
(``ValueError`` naming both otherwise); rows may be left- or right-padded (``attention_mask``
0 on padding); the logits equal the model's own forward with ``pixel_values`` wherever the
generated output holds no placeholder token.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from rollstream.vision.inputs import VisionInputs


def is_vision_model(model: Any) -> bool:
    """True for a Qwen2-VL-style model (an image token id and a vision config)."""
    config = getattr(model, "config", None)
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def image_token_id(model: Any) -> int:
    return int(model.config.image_token_id)


def merge_size(model: Any) -> int:
    return int(model.config.vision_config.spatial_merge_size)


def image_tokens(image_grid_thw: Tensor, merge: int) -> list[int]:
    """Placeholder tokens each image takes: ``t * h * w / merge**2`` per ``image_grid_thw`` row."""
    return (image_grid_thw.prod(-1) // (merge * merge)).tolist()


def prompt_placeholders(input_ids: Tensor, loss_mask: Tensor, attention_mask: Tensor, token_id: int) -> Tensor:
    """Image slots of ``[N, L]`` trajectory rows: the placeholder token at attended positions
    that were not generated (``loss_mask == 0``)."""
    return (input_ids == token_id) & (loss_mask == 0) & attention_mask.bool()


def check_placeholders(placeholders: Tensor, vision: VisionInputs | None, merge: int, what: str = "the batch") -> None:
    """``ValueError`` unless each row's image slots match the image tokens of the images it shows."""
    per_image = image_tokens(vision.image_grid_thw, merge) if vision is not None else []
    for row, slots in enumerate(placeholders.sum(-1).tolist()):
        images = vision.row_images[row] if vision is not None else []
        tokens = sum(per_image[i] for i in images)
        if slots != tokens:
            raise ValueError(
                f"row {row} of {what} has {slots} image placeholder tokens but its {len(images)} images make "
                f"{tokens} image tokens: the prompt was built with other images or another image "
                "processor setting (min_pixels/max_pixels)"
            )


def input_embeddings(model: Any, input_ids: Tensor, placeholders: Tensor, vision: VisionInputs | None) -> Tensor:
    """Token embeddings of ``input_ids`` with each row's image features in its ``placeholders``
    (the vision tower runs once per distinct image)."""
    embeds = model.get_input_embeddings()(input_ids)
    check_placeholders(placeholders, vision, merge_size(model))
    if vision is None or not vision.slot_order():
        return embeds
    features = model.model.get_image_features(vision.pixel_values, vision.image_grid_thw, return_dict=True).pooler_output
    slots = torch.cat([features[i] for i in vision.slot_order()])
    return embeds.masked_scatter(placeholders.unsqueeze(-1), slots.to(embeds.dtype))


def rope_positions(
    model: Any, input_ids: Tensor, placeholders: Tensor, vision: VisionInputs | None, attention_mask: Tensor,
) -> tuple[Tensor, Tensor]:
    """``(position_ids [3, B, L], deltas [B])``: M-RoPE positions over attended tokens, and per
    row the offset of the next token's position from its count of tokens (0 without images)."""
    order = vision.slot_order() if vision is not None else []
    grid = vision.image_grid_thw[order] if vision is not None and order else None
    _check_rope_index(model)
    positions, deltas = model.model.get_rope_index(
        input_ids, mm_token_type_ids=placeholders.long(), image_grid_thw=grid, attention_mask=attention_mask,
    )
    return positions, deltas.reshape(-1)


def _check_rope_index(model: Any) -> None:
    """Image slots are given to ``get_rope_index`` as ``mm_token_type_ids``; older transformers
    found them by scanning the ids, generated ones included, which this recipe must avoid."""
    if "mm_token_type_ids" not in inspect.signature(model.model.get_rope_index).parameters:
        import transformers

        raise RuntimeError(
            f"rollstream's vision-language support needs a transformers whose Qwen2-VL get_rope_index takes "
            f"mm_token_type_ids (5.17 and 5.24 do); this is transformers {transformers.__version__}"
        )


def vision_logits(
    model: Any, input_ids: Tensor, attention_mask: Tensor, placeholders: Tensor, vision: VisionInputs | None,
) -> Tensor:
    """``[N, L, V]`` logits of a full forward pass (no cache) over ``input_ids`` with images."""
    embeds = input_embeddings(model, input_ids, placeholders, vision)
    positions, _ = rope_positions(model, input_ids, placeholders, vision, attention_mask)
    return model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions, use_cache=False).logits


def trajectory_logits(model: Any, tensors: Mapping[str, Tensor], vision: VisionInputs | None) -> Tensor:
    """``[N, L, V]`` logits of ``[N, L]`` trajectory rows (``input_ids``, ``attention_mask``,
    ``loss_mask``) with the images the rows show: the trainer side's forward pass."""
    device = model.get_input_embeddings().weight.device
    ids = tensors["input_ids"].to(device=device, dtype=torch.long)
    mask = tensors["attention_mask"].to(device=device, dtype=torch.long)
    placeholders = prompt_placeholders(ids, tensors["loss_mask"].to(device), mask, image_token_id(model))
    if vision is not None:
        vision = VisionInputs(vision.pixel_values.to(device), vision.image_grid_thw.to(device), vision.row_images)
    return vision_logits(model, ids, mask, placeholders, vision)

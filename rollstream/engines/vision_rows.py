"""The vision side of the local engine for a Qwen2-VL-style model (``rollstream.vision.forward``).

A request's ``image_data`` (base64 text, data URIs or file paths, as SGLang takes them) is
decoded and processed once, when the request arrives (:meth:`EngineVision.prepare`); its
images go into every prefill of the request (the first one, and the recomputation after a
weight update), never into decode passes, which only need each row's M-RoPE offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rollstream.api.engine import InvalidRequestError
from rollstream.vision.forward import check_placeholders, image_token_id, input_embeddings, merge_size, rope_positions
from rollstream.engines.request_check import request_image
from rollstream.vision.inputs import VisionInputs, process_images


class EngineVision:
    """Image preparation and prefill inputs for one VLM and its image processor."""

    def __init__(self, model: Any, image_processor: Any) -> None:
        self.model = model
        self.image_processor = image_processor
        self.image_token_id = image_token_id(model)
        self.merge = merge_size(model)

    def prepare(self, prompt: Sequence[int], image_data: Sequence[Any] | None) -> VisionInputs | None:
        """The request's images as one row's :class:`VisionInputs` (``None`` without images).

        ``InvalidRequestError`` for an entry that is not an image, or when the prompt's image
        placeholder tokens do not match the image tokens its images make."""
        images = [request_image(item, i) for i, item in enumerate(image_data or [])]
        vision = None
        if images:
            pixel_values, grid = process_images(self.image_processor, images)
            vision = VisionInputs(pixel_values, grid, [list(range(len(images)))])
        placeholders = torch.tensor([[t == self.image_token_id for t in prompt]])
        try:
            check_placeholders(placeholders, vision, self.merge, what="the request")
        except ValueError as exc:
            raise InvalidRequestError(
                f"{exc}; send the input_ids the model's processor made for these image_data"
            ) from None
        return vision

    def prefill(
        self, ids: Tensor, mask: Tensor, prompt_spans: Sequence[tuple[int, int]], visions: Sequence[VisionInputs | None],
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(inputs_embeds, position_ids [3, B, L], deltas [B])`` of left-padded rows.

        ``prompt_spans[r]`` is ``(start, end)`` of row ``r``'s prompt in ``ids``: image slots are
        placeholder tokens there only (generated tokens never are)."""
        placeholders = torch.zeros_like(ids, dtype=torch.bool)
        for row, (start, end) in enumerate(prompt_spans):
            placeholders[row, start:end] = ids[row, start:end] == self.image_token_id
        vision = _rows_vision(visions, self.model)
        embeds = input_embeddings(self.model, ids, placeholders, vision)
        positions, deltas = rope_positions(self.model, ids, placeholders, vision, mask)
        return embeds, positions, deltas

    @staticmethod
    def decode_positions(counts: Tensor, deltas: Sequence[int]) -> Tensor:
        """``[3, B, 1]`` positions of the next tokens: tokens so far plus each row's offset."""
        offsets = torch.tensor(deltas, dtype=counts.dtype, device=counts.device).reshape(-1, 1)
        return (counts + offsets).unsqueeze(0).expand(3, -1, -1)


def _rows_vision(visions: Sequence[VisionInputs | None], model: Any) -> VisionInputs | None:
    """One :class:`VisionInputs` for rows that may lack images (their ``row_images`` are empty)."""
    if all(v is None for v in visions):
        return None
    device = model.get_input_embeddings().weight.device
    dim = next(v for v in visions if v is not None).pixel_values.shape[-1]
    empty = VisionInputs(torch.zeros(0, dim), torch.zeros(0, 3, dtype=torch.int64), [[]])
    merged = VisionInputs.concat([v if v is not None else empty for v in visions])
    return VisionInputs(merged.pixel_values.to(device), merged.image_grid_thw.to(device), merged.row_images)

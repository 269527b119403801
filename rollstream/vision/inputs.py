"""The images of a batch of rows as a VLM's forward pass takes them: :class:`VisionInputs`.

Each distinct image is processed (and later run through the vision tower) once, however many
rows show it; ``row_images`` says which images each row shows, in the order of its image slots.
The trainer side builds them from the encoded images a batch carries
(:func:`build_vision_inputs`), the engine from each request's images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rollstream.vision.images import open_image

MULTI_MODAL_KEY = "multi_modal_input"  # AReaL's per-row list of vision-input dicts
# What a workflow may return beside the trajectory for a VLM trainer: AReaL's
# multi_modal_input, or (its older form) pixel_values / image_grid_thw as keys of their own.
VISION_RESULT_KEYS = (MULTI_MODAL_KEY, "pixel_values", "image_grid_thw")


def result_image_counts(result: dict[str, Any]) -> list[int] | None:
    """Images per row the vision inputs of a workflow's ``result`` describe (from their
    ``image_grid_thw``), or ``None`` when the result has none."""
    rows = result.get(MULTI_MODAL_KEY)
    if isinstance(rows, list):
        return [_grid_rows(row.get("image_grid_thw") if isinstance(row, dict) else None) for row in rows]
    grid = result.get("image_grid_thw")
    if isinstance(grid, Tensor):
        return [_grid_rows(g) for g in grid] if grid.dim() == 3 else [_grid_rows(grid)]
    return None


def _grid_rows(grid: Any) -> int:
    return int(grid.shape[0]) if isinstance(grid, Tensor) and grid.dim() == 2 else 0


@dataclass(frozen=True)
class VisionInputs:
    """Distinct images and which rows show them.

    ``pixel_values`` ``[P, D]`` float32: the patches of every distinct image, image after image
    (image ``i`` has ``image_grid_thw[i].prod()`` of them); ``image_grid_thw`` ``[M, 3]`` int64:
    one ``(t, h, w)`` per distinct image; ``row_images[r]``: indexes of the images row ``r``
    shows, in the order of its image slots (``[]`` for a row without images).
    """

    pixel_values: Tensor
    image_grid_thw: Tensor
    row_images: list[list[int]]

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def slot_order(self) -> list[int]:
        """The image of every image slot of the rows, rows in order: row 0's images, then row 1's..."""
        return [i for images in self.row_images for i in images]

    def patches(self, image: int) -> Tensor:
        """The ``pixel_values`` rows of one image."""
        counts = self.image_grid_thw.prod(-1)
        start = int(counts[:image].sum())
        return self.pixel_values[start: start + int(counts[image])]

    def select(self, rows: Sequence[int]) -> VisionInputs:
        """The inputs of ``rows`` alone (e.g. a micro-batch), keeping only the images they show."""
        used = sorted({i for r in rows for i in self.row_images[r]})
        new_index = {old: new for new, old in enumerate(used)}
        return VisionInputs(
            pixel_values=torch.cat([self.patches(i) for i in used]) if used else self.pixel_values[:0],
            image_grid_thw=self.image_grid_thw[used] if used else self.image_grid_thw[:0],
            row_images=[[new_index[i] for i in self.row_images[r]] for r in rows],
        )

    @staticmethod
    def concat(parts: Sequence[VisionInputs]) -> VisionInputs:
        """The rows of ``parts`` one after the other (images are not merged across parts)."""
        row_images: list[list[int]] = []
        offset = 0
        for part in parts:
            row_images += [[offset + i for i in images] for images in part.row_images]
            offset += part.num_images
        return VisionInputs(
            pixel_values=torch.cat([p.pixel_values for p in parts]),
            image_grid_thw=torch.cat([p.image_grid_thw for p in parts]),
            row_images=row_images,
        )


def process_images(image_processor: object, images: Sequence[bytes]) -> tuple[Tensor, Tensor]:
    """``(pixel_values, image_grid_thw)`` of encoded ``images`` (at least one), in order."""
    out = image_processor(images=[open_image(data) for data in images], return_tensors="pt")  # type: ignore[operator]
    return out["pixel_values"].to(torch.float32), out["image_grid_thw"].to(torch.int64)


def build_vision_inputs(image_processor: object, row_images: Sequence[Sequence[bytes]]) -> VisionInputs | None:
    """The :class:`VisionInputs` of rows showing ``row_images`` (encoded image files per row, in
    slot order); equal images are processed once. ``None`` when no row shows an image."""
    distinct: dict[bytes, int] = {}
    for images in row_images:
        for data in images:
            distinct.setdefault(bytes(data), len(distinct))
    if not distinct:
        return None
    pixel_values, grid = process_images(image_processor, list(distinct))
    return VisionInputs(pixel_values, grid, [[distinct[bytes(d)] for d in images] for images in row_images])

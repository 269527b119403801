"""A dataset row's images, made ready for the ``prompts`` topic.

The images of a row (``row["images"]``, ``rollstream.vision.IMAGES_KEY``: one image or a list,
as bytes, PIL images, file paths, base64 text, data URIs or datasets' ``{"bytes", "path"}``
dicts) travel as the encoded image files themselves: paths are read here, where the dataset
is, and base64 is decoded (a third smaller on the wire). The rollout worker and the trainer
side then never need the producer's files.
"""

from __future__ import annotations

from typing import Any

from rollstream.vision.images import IMAGES_KEY, image_bytes, image_list


def with_encoded_images(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` itself without images, else a copy whose ``images`` is a list of encoded image
    files (``bytes``). Raises ``rollstream.vision.ImageError`` naming the bad image."""
    if row.get(IMAGES_KEY) is None:
        return row
    images = [image_bytes(img, f"{IMAGES_KEY}[{i}]") for i, img in enumerate(image_list(row[IMAGES_KEY]))]
    return {**row, IMAGES_KEY: images}


def image_sizes(row: dict[str, Any]) -> list[int]:
    """Byte sizes of the row's encoded images (after :func:`with_encoded_images`)."""
    return [len(img) for img in row.get(IMAGES_KEY) or [] if isinstance(img, bytes)]

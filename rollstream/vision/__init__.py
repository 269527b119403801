"""Vision support shared by the tiers: images as bytes, processors, VLM forward passes, and
the vision inputs a trainer receives (see docs/ARCHITECTURE.md, "Images travel once")."""

from rollstream.vision.images import (
    IMAGES_KEY,
    ImageError,
    image_bytes,
    image_digest,
    image_list,
    open_image,
    to_base64,
)

__all__ = [
    "IMAGES_KEY",
    "ImageError",
    "image_bytes",
    "image_digest",
    "image_list",
    "open_image",
    "to_base64",
]

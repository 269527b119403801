"""RLVR with images: ``data["images"]`` goes to the engine as ``ModelRequest.image_data``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollstream.api.io_struct import ModelRequest
from rollstream.workflows.rlvr import RLVRWorkflow


def image_data(data: Mapping[str, Any], key: str = "images") -> list[str] | None:
    """The images of ``data`` as a list of strings (base64 data or file paths), or ``None``.

    A single string is taken as a one-image list; anything else raises ``TypeError``.
    """
    images = data.get(key)
    if images is None:
        return None
    if isinstance(images, str):
        return [images]
    if isinstance(images, (list, tuple)) and all(isinstance(i, str) for i in images):
        return list(images)
    raise TypeError(f"data[{key!r}] must be a list of base64 strings or paths, got {type(images).__name__}")


class VisionRLVRWorkflow(RLVRWorkflow):
    """:class:`RLVRWorkflow` that also sends ``data["images"]`` to the engine.

    The prompt ids come from ``data`` as in RLVR (so they must already hold whatever image
    placeholder tokens the model expects); the result has the same keys as RLVR.
    """

    image_key: str = "images"

    def make_request(self, prompt_ids: list[int], data: Mapping[str, Any]) -> ModelRequest:
        req = super().make_request(prompt_ids, data)
        req.image_data = image_data(data, self.image_key)
        return req

"""Loading a VLM's processor (for workflows) and its image processor (for engines and trainers).

:func:`load_processor` is what the rollout worker hands a workflow for ``"$processor"``:
``AutoProcessor.from_pretrained(path)``. transformers' Qwen2-VL processor also builds a video
processor, which needs torchvision; where that is missing (CPU test machines) and the
directory holds a Qwen2-VL image processor, an ``ImageOnlyQwen2VLProcessor`` is built
from the same files instead: transformers' own Qwen2-VL processing (placeholder expansion,
``pixel_values``, ``image_grid_thw``), without the video half.

:func:`load_image_processor` is what engines and the trainer side use to turn images into
``pixel_values`` / ``image_grid_thw``: ``AutoImageProcessor.from_pretrained(path)``. The
rollout's engine and the trainer side must load the same image processor settings
(``min_pixels``/``max_pixels``...): the trainer side checks that each row's image placeholders
match the images it rebuilt, so a mismatch is an error, never silently wrong inputs.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

QWEN2_VL_IMAGE_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil")


def load_image_processor(path: str | Path) -> Any:
    """``AutoImageProcessor.from_pretrained(path)``; ``ValueError`` naming the path when the
    directory has no image processor (``preprocessor_config.json``)."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load an image processor from {str(path)!r}: {exc}") from exc


def load_processor(path: str | Path) -> Any:
    """The processor of the VLM at ``path`` (see the module docstring)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(path))
    except Exception as exc:  # transformers raises several types for a missing video backend
        if not _has_qwen2_vl_image_processor(Path(path)):
            raise
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        log.info("AutoProcessor(%s) failed (%s: %s); using its image and text halves", path, type(exc).__name__, first_line)
    from transformers import AutoTokenizer

    return image_only_qwen2_vl_class()(load_image_processor(path), AutoTokenizer.from_pretrained(str(path)))


def _has_qwen2_vl_image_processor(path: Path) -> bool:
    config = path / "preprocessor_config.json"
    if not config.is_file():
        return False
    try:
        kind = json.loads(config.read_text()).get("image_processor_type", "")
    except (OSError, ValueError):
        return False
    return kind in QWEN2_VL_IMAGE_PROCESSORS


@functools.cache
def image_only_qwen2_vl_class() -> type:
    """``ImageOnlyQwen2VLProcessor`` (made on first use: it imports transformers' Qwen2-VL processor)."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """transformers' Qwen2-VL processor without its video processor (which needs torchvision).

        Same ``__call__``/``apply_chat_template`` for text and images; videos are refused.
        """

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs: Any) -> None:
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            template = chat_template or getattr(tokenizer, "chat_template", None)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=template, **kwargs)

    return ImageOnlyQwen2VLProcessor


"""The tiny offline model and the tokenizer and generation settings workflows receive.

``tiny_model_dir()`` builds the project's tiny Qwen2 model and byte-level BPE tokenizer
(``rollstream.tiny.text_model``, no hub access) once into ``$ROLLSTREAM_CACHE_DIR/tiny-model``
(default ``~/.cache/rollstream``) and returns it. ``workflow_tokenizer`` and
``workflow_gconfig`` give what a rollout worker hands to a workflow for ``"$tokenizer"`` and
``"$gconfig"``. ``tiny_vlm_dir()`` does the same for the tiny vision-language model
(``rollstream.tiny.vlm``) in ``tiny-vlm``; ``workflow_processor`` is what a workflow receives
for ``"$processor"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollstream.api.io_struct import GenerationHyperparameters
from rollstream.config import cache_dir
from rollstream.tiny.text_model import ensure_tiny_model
from rollstream.tiny.vlm import ensure_tiny_vlm


def tiny_model_dir(path: Path | str | None = None) -> Path:
    """The tiny model directory (built on first use; idempotent and safe to call concurrently)."""
    return ensure_tiny_model(Path(path) if path is not None else cache_dir() / "tiny-model")


def tiny_vlm_dir(path: Path | str | None = None) -> Path:
    """The tiny vision-language model directory (built on first use, like :func:`tiny_model_dir`)."""
    return ensure_tiny_vlm(Path(path) if path is not None else cache_dir() / "tiny-vlm")


def workflow_processor(model_dir: Path | str) -> Any:
    """The processor of ``model_dir`` as workflows receive it for ``"$processor"``."""
    from rollstream.vision.processor import load_processor

    return load_processor(model_dir)


def workflow_tokenizer(model_dir: Path | str) -> Any:
    """The tokenizer of ``model_dir`` as workflows receive it: ``AutoTokenizer.from_pretrained``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def workflow_gconfig(tokenizer: Any, **settings: Any) -> GenerationHyperparameters:
    """``rollout.gconfig`` settings as a workflow receives them: with the tokenizer's stop and
    pad ids (``max_new_tokens`` defaults to 8 here, so tests on the tiny model stay fast)."""
    settings.setdefault("max_new_tokens", 8)
    return GenerationHyperparameters().new(**settings).new_with_stop_and_pad_token_ids(tokenizer)

"""A tiny Qwen2-VL-style vision-language model and processor built offline, for CPU tests.

Model hubs are unreachable in the test environment, so the project builds its own: the byte-level
BPE tokenizer of ``rollstream.tiny.text_model`` with Qwen2-VL's vision special tokens added, a
randomly initialised ``Qwen2VLForConditionalGeneration`` (a one-block vision tower, a two-layer
language model), and a Qwen2-VL image processor that keeps images small. The result is a normal
Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer files,
``preprocessor_config.json``, ``processor_config.json``) that ``AutoModelForImageTextToText``,
``AutoImageProcessor`` and :func:`rollstream.vision.processor.load_processor` load unchanged.

Callers may rely on:

* ``build_tiny_vlm`` is deterministic for the same arguments and idempotent (a complete
  directory built with the same arguments is returned untouched); it builds in a temporary
  sibling directory, so a crash never leaves a half-written model;
* the tokenizer holds ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>`` and
  ``<|video_pad|>`` as special tokens; its chat template renders ``{"type": "image"}`` content
  items as ``<|vision_start|><|image_pad|><|vision_end|>`` (Qwen2-VL's form) and string
  contents as text; eos and pad are ``<|endoftext|>``;
* the image processor resizes every image to between ``min_pixels`` and ``max_pixels``
  (defaults 28x28 and 56x56 pixels: 1 to 4 image tokens per image);
* ``python -m rollstream.tiny.vlm OUT_DIR`` builds the default model into ``OUT_DIR``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from rollstream.tiny.text_model import (
    EOS_TOKEN, IM_END, IM_START, _config_hash, _train_tokenizer, build_once, default_corpus, seeded_model, write_marker,
)

logger = logging.getLogger(__name__)

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
_RECIPE = "tiny-vlm-1"  # change when the build recipe changes so that old directories are rebuilt

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{ item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _tokenizer(corpus: list[str], vocab_size: int) -> Any:
    tokenizer = _train_tokenizer(corpus, vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END, *VISION_TOKENS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _image_processor(params: dict[str, int]) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=params["min_pixels"], max_pixels=params["max_pixels"])


def _model(tokenizer: Any, params: dict[str, int]) -> Any:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD),
        ("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END))}
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    hidden, heads = params["hidden_size"], params["num_heads"]
    head_dim = hidden // heads
    # M-RoPE splits each head's rotary half (head_dim / 2) over time, height and width.
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": params["num_layers"], "num_attention_heads": heads,
            "num_key_value_heads": heads // 2 if heads % 2 == 0 else heads,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0},
            "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos,
        },
        vision_config={
            "depth": 1, "embed_dim": params["vision_dim"], "hidden_size": hidden, "num_heads": 2,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        },
        **ids,
    )
    return seeded_model(Qwen2VLForConditionalGeneration, config, params["seed"], eos)


def _write(tmp: Path, corpus: list[str], params: dict[str, int], config_hash: str) -> None:
    tokenizer = _tokenizer(corpus, params["vocab_size"])
    _model(tokenizer, params).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _image_processor(params).save_pretrained(tmp)
    # transformers' processor class, so AutoProcessor builds the real one where torchvision is
    # installed; rollstream.vision.processor.load_processor falls back to its image half elsewhere.
    (tmp / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2))
    write_marker(tmp, config_hash, params, len(tokenizer))


def build_tiny_vlm(
    out_dir: Path,
    corpus: list[str] | None = None,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    vision_dim: int = 32,
    min_pixels: int = 28 * 28,
    max_pixels: int = 56 * 56,
    seed: int = 0,
) -> Path:
    """Build the tiny VLM into ``out_dir`` (see the module docstring); returns ``out_dir``."""
    out_dir = Path(out_dir)
    corpus = list(corpus) if corpus is not None else default_corpus()
    params = {
        "recipe": _RECIPE, "vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers,
        "num_heads": num_heads, "vision_dim": vision_dim, "min_pixels": min_pixels, "max_pixels": max_pixels,
        "seed": seed,
    }
    config_hash = _config_hash(corpus, params)  # type: ignore[arg-type]
    return build_once(out_dir, config_hash, lambda tmp: _write(tmp, corpus, params, config_hash), "tiny VLM")


def ensure_tiny_vlm(path: Path | str) -> Path:
    """The default tiny VLM at ``path``, built if needed."""
    return build_tiny_vlm(Path(path))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the tiny offline vision-language model.")
    parser.add_argument("out_dir", type=Path)
    print(ensure_tiny_vlm(parser.parse_args(argv).out_dir))


if __name__ == "__main__":
    main()

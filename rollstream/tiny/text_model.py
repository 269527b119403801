"""A tiny causal LM and tokenizer built offline, for CPU tests and the local demo.

Model hubs are unreachable in the test environment, so the project trains its own byte-level
BPE tokenizer on a small corpus and wraps a randomly initialised Qwen2 model around it.
The result is a normal Hugging Face directory (``config.json``, ``model.safetensors``,
``tokenizer.json``, ...) that ``AutoTokenizer`` / ``AutoModelForCausalLM`` load unchanged.

Callers may rely on:

* ``build_tiny_model`` is deterministic for the same arguments and idempotent: a directory that
  already holds a complete model built with the same arguments is returned untouched.
* The tokenizer's eos and pad token are ``<|endoftext|>``; ``<|im_start|>`` and ``<|im_end|>``
  are special tokens, and ``apply_chat_template`` produces Qwen-style chat text, with tools
  (``tools=``), assistant tool calls and ``tool`` messages (see :data:`CHAT_TEMPLATE`).
* ``python -m rollstream.tiny.text_model OUT_DIR`` builds the default model into ``OUT_DIR``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]
MARKER_FILE = "rollstream_tiny_model.json"
# Bump when the build recipe changes so that old directories are rebuilt.
_RECIPE_VERSION = 3  # 2: the chat template renders tools and tool calls; 3: two heads of 32 (vLLM)

# Qwen-style chat text. With ``tools`` a system turn lists them (after the caller's own system
# message, which it absorbs) and says how to call one; an assistant's ``tool_calls`` render as
# ``<tool_call>`` blocks (``arguments`` a JSON string or a mapping) and a ``tool`` message is a
# turn of its own. Without tools the text is exactly ``<|im_start|>role\ncontent<|im_end|>\n``
# per message, as in recipe 1.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nTo call a tool, answer with <tool_call>\\n{\"name\": <name>, "
    "\"arguments\": <json object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def default_corpus() -> list[str]:
    """Simple arithmetic question/answer lines ("What is 3+4? Answer: 7") for the demo."""
    lines: list[str] = []
    for a in range(20):
        for b in range(20):
            lines.append(f"What is {a}+{b}? Answer: {a + b}")
            if a >= b:
                lines.append(f"What is {a}-{b}? Answer: {a - b}")
            if a < 10 and b < 10:
                lines.append(f"What is {a}*{b}? Answer: {a * b}")
    lines.append(f"{IM_START}user\nWhat is 2+2?{IM_END}\n{IM_START}assistant\nAnswer: 4{IM_END}")
    return lines


def _config_hash(corpus: list[str], params: dict[str, int]) -> str:
    payload = json.dumps({"recipe": _RECIPE_VERSION, "corpus": corpus, "params": params}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def _is_complete(out_dir: Path, config_hash: str) -> bool:
    marker = out_dir / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text()).get("config_hash")
    except (OSError, ValueError):
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return recorded == config_hash and all((out_dir / name).is_file() for name in needed)


def _train_tokenizer(corpus: list[str], vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # The full byte alphabet keeps every string encodable, whatever the corpus holds.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_model(vocab: int, eos_id: int, params: dict[str, int]):  # -> Qwen2ForCausalLM
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = params["num_heads"]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=params["hidden_size"],
        intermediate_size=4 * params["hidden_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=heads,
        # Grouped-query attention (as in real Qwen2 checkpoints) when the head count allows it.
        num_key_value_heads=heads // 2 if heads % 2 == 0 else heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return seeded_model(Qwen2ForCausalLM, config, params["seed"], eos_id)


def seeded_model(model_class: Any, config: Any, seed: int, eos_id: int) -> Any:
    """``model_class(config)`` with weights drawn from ``seed`` (the caller's global RNG state
    stays untouched), generating until ``eos_id``, in eval mode."""
    import torch
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id)
    return model.eval()


def write_marker(tmp: Path, config_hash: str, params: dict[str, int], vocab: int) -> None:
    """The build's marker, written last: its presence means the directory is complete."""
    marker = {"config_hash": config_hash, "params": params, "vocab": vocab}
    (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2))


def _write_model(tmp: Path, corpus: list[str], params: dict[str, int], config_hash: str) -> None:
    tokenizer = _train_tokenizer(corpus, params["vocab_size"])
    model = _build_model(len(tokenizer), tokenizer.eos_token_id, params)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    write_marker(tmp, config_hash, params, len(tokenizer))


def _install(tmp: Path, out_dir: Path, config_hash: str) -> None:
    """Move the finished build into place, tolerating a concurrent builder."""
    if out_dir.exists():
        if not (out_dir / MARKER_FILE).exists() and any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} exists, is not empty and was not built by build_tiny_model")
        shutil.rmtree(out_dir)
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if not _is_complete(out_dir, config_hash):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same build first


def build_tiny_model(
    out_dir: Path,
    corpus: list[str],
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    seed: int = 0,
) -> Path:
    """Train a BPE tokenizer on ``corpus``, build a random tiny Qwen2 model, save both.

    ``vocab_size`` is the BPE target; the model's vocabulary is the trained tokenizer's size
    (at most ``vocab_size``). Returns ``out_dir``. The defaults give attention heads of 32
    (hidden 64, 2 heads), the smallest head size vLLM's CPU attention serves; a head size of 16
    loads and then fails on the first request.
    """
    out_dir = Path(out_dir)
    params = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "seed": seed,
    }
    config_hash = _config_hash(list(corpus), params)
    return build_once(out_dir, config_hash, lambda tmp: _write_model(tmp, list(corpus), params, config_hash), "tiny model")


def build_once(out_dir: Path, config_hash: str, write: Callable[[Path], None], what: str) -> Path:
    """``out_dir`` as ``write`` makes it, unless a complete build of ``config_hash`` is there.
    ``write`` fills a sibling temp dir that then takes ``out_dir``'s place, so a crash never
    leaves a half-written model behind and concurrent builders agree."""
    if _is_complete(out_dir, config_hash):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model is meant to be shared
    try:
        write(tmp)
        _install(tmp, out_dir, config_hash)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built %s in %s", what, out_dir)
    return out_dir


def ensure_tiny_model(path: Path | str) -> Path:
    """The default tiny model (default corpus and sizes) at ``path``, built if needed."""
    return build_tiny_model(Path(path), default_corpus())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the tiny offline model and tokenizer.")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    print(ensure_tiny_model(args.out_dir))


if __name__ == "__main__":
    main()

"""The tokenizer that tiers which only decode ids use, loaded without torch.

``transformers`` imports torch when it is imported (about 500 MB of RSS), and the dump tier,
the reward tier and the debugging tools only decode ids. :func:`load_tokenizer` therefore
reads the model directory's ``tokenizer.json`` with the ``tokenizers`` library (what
transformers' fast tokenizers wrap) and decodes as transformers 5 does: the backend's
``decode``, then transformers' clean-up of spaces before punctuation only where
``tokenizer_config.json`` asks for it and the model is not BPE (transformers skips it for BPE).
A path that is not a directory is a hub id: its tokenizer files come from the Hugging Face
cache (``HF_HOME``), downloaded there when missing (``huggingface_hub``, which ``tokenizers``
depends on). A directory without ``tokenizer.json``, or whose ``tokenizer_config.json`` names
tokens the file does not hold (transformers would add them), is loaded with transformers'
``AutoTokenizer`` instead, with a warning that this imports torch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as Backend

log = logging.getLogger(__name__)

__all__ = ["FileTokenizer", "Tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    """The one tokenizer method dumps need (a Hugging Face tokenizer has it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class FileTokenizer:
    """A ``tokenizer.json`` (``tokenizers.Tokenizer``) that decodes as transformers does. Its
    attributes have the names of transformers' fast tokenizer (``backend_tokenizer``,
    ``clean_up_tokenization_spaces``), so code that inspects one takes the other."""

    def __init__(self, backend: Backend, clean_up_spaces: bool = False) -> None:
        self.backend_tokenizer = backend
        self.clean_up_tokenization_spaces = clean_up_spaces

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)  # numpy arrays too
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text


# What a tokenizer is made of on the hub (weights and the rest are not fetched).
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.*", "merges.txt", "*.model"]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the model directory ``path``, or of the hub id ``path`` (see the
    module docstring, also for when transformers, and so torch, is loaded instead). Raises
    ``OSError`` or ``ValueError`` when there is none."""
    directory = Path(path)
    if not directory.is_dir():
        directory = _hub_directory(str(path))
    tokenizer = _from_file(directory) if (directory / "tokenizer.json").is_file() else None
    if tokenizer is not None:
        return tokenizer
    log.warning(
        "%s: no tokenizer.json that holds every token of tokenizer_config.json; loading transformers' "
        "AutoTokenizer, which imports torch (~500 MB more in this process)", directory,
    )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _hub_directory(repo_id: str) -> Path:
    """The cached tokenizer files of the hub model ``repo_id`` (fetched when missing)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=TOKENIZER_FILES))
    except HFValidationError:
        raise OSError(f"{repo_id!r} is neither a directory nor a hub model id") from None


def _from_file(directory: Path) -> FileTokenizer | None:
    backend = Backend.from_file(str(directory / "tokenizer.json"))
    config_file = directory / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if not _holds_config_tokens(backend, config):
        return None
    clean_up = bool(config.get("clean_up_tokenization_spaces", False))
    if clean_up and type(backend.model).__name__ == "BPE":
        clean_up = bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    return FileTokenizer(backend, clean_up)


_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _holds_config_tokens(backend: Backend, config: dict[str, Any]) -> bool:
    """True when every token ``config`` names (``added_tokens_decoder`` with its id, the
    special tokens, ``extra_special_tokens``, ``additional_special_tokens``) is already in
    ``backend``, so transformers would add none."""
    for token_id, token in (config.get("added_tokens_decoder") or {}).items():
        if backend.token_to_id(_content(token)) != int(token_id):
            return False
    named = [config.get(key) for key in _SPECIAL_TOKEN_KEYS]
    for key in ("extra_special_tokens", "additional_special_tokens"):
        listed = config.get(key) or []
        named += list(listed.values()) if isinstance(listed, dict) else list(listed)
    return all(backend.token_to_id(_content(token)) is not None for token in named if token)


def _content(token: Any) -> str:
    return str(token.get("content")) if isinstance(token, dict) else str(token)


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (spaces before punctuation and contractions)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text

"""The tokenizer of the dump and reward tiers (``rollstream.tokenizer_file``): read from tokenizer.json without
transformers, decoding exactly as transformers' tokenizer does; transformers only where the
file alone would decode differently."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer

from rollstream.tokenizer_file import FileTokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[2]


def id_sequences(vocab: int) -> list[list[int]]:
    """Plain, special-token and out-of-order ids, and an empty sequence."""
    return [[], list(range(vocab)), list(range(vocab - 1, -1, -7)), [5, 5, 5, 0, 1, 2]]


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_vlm_dir"])
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decodes_as_transformers_does(model: str, skip_special_tokens: bool, request: pytest.FixtureRequest) -> None:
    directory = request.getfixturevalue(model)
    ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))
    assert isinstance(ours, FileTokenizer)
    for ids in id_sequences(len(theirs)):
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == theirs.decode(
            ids, skip_special_tokens=skip_special_tokens)


def test_loading_it_imports_neither_torch_nor_transformers(tiny_model_dir: Path) -> None:
    code = ("import sys\nfrom rollstream.tokenizer_file import load_tokenizer\n"
            f"print(load_tokenizer({str(tiny_model_dir)!r}).decode([1, 2, 3]))\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_hub_id_is_read_from_the_hugging_face_cache(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``reward.tokenizer_path: org/model`` (the compose config's form): the tokenizer files of
    the cached snapshot, still without transformers (offline here: nothing is downloaded)."""
    model = tmp_path / "hub" / "models--someorg--tiny"
    snapshot = model / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, snapshot / name)
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text("0123abcd")
    code = ("import sys\nfrom rollstream.tokenizer_file import FileTokenizer, load_tokenizer\n"
            "tokenizer = load_tokenizer('someorg/tiny')\n"
            "assert isinstance(tokenizer, FileTokenizer), tokenizer\n"
            "print(tokenizer.decode([1, 2, 3]))\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == AutoTokenizer.from_pretrained(str(tiny_model_dir)).decode([1, 2, 3])


def test_a_path_that_is_neither_a_directory_nor_a_hub_id_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="neither a directory nor a hub model id"):
        load_tokenizer(tmp_path / "missing")


def word_level(directory: Path, config: dict) -> Path:
    """A WordLevel tokenizer (not BPE: transformers applies its space clean-up when asked)."""
    directory.mkdir()
    vocab = {"hello": 0, ",": 1, "world": 2, "[UNK]": 3, "!": 4, "n't": 5, "do": 6}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", **config}))
    return directory


@pytest.mark.parametrize("clean_up", [True, False])
def test_spaces_are_cleaned_up_where_transformers_cleans_them(tmp_path: Path, clean_up: bool) -> None:
    directory = word_level(tmp_path / "wl", {"clean_up_tokenization_spaces": clean_up})
    ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))
    ids = [0, 1, 2, 4, 6, 5]
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.decode(ids) == ("hello, world! don't" if clean_up else "hello , world ! do n't")


def test_tokens_only_the_config_names_need_transformers(tmp_path: Path, tiny_model_dir: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "model"
    shutil.copytree(tiny_model_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = [*config.get("extra_special_tokens", []), "<|only_in_config|>"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="rollstream.tokenizer_file"):
        tokenizer = load_tokenizer(directory)
    assert not isinstance(tokenizer, FileTokenizer)
    added = tokenizer.convert_tokens_to_ids("<|only_in_config|>")  # transformers added it: we decode it too
    assert tokenizer.decode([added]) == "<|only_in_config|>"
    assert "loading transformers' AutoTokenizer, which imports torch" in caplog.text

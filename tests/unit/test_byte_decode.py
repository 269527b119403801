"""ByteLevelDecoder: the same text as the tokenizer's own decode, or no decoder at all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import pytest
from transformers import AutoTokenizer

from harness.fakes import make_tokenizer
from rollstream.reward_workers.byte_decode import ByteLevelDecoder
from rollstream.tokenizer_file import FileTokenizer, load_tokenizer


TEXT = "héllo wörld, 日本語 🙂 answer: 42<|im_end|>\n\tdone"


def own_decode(tokenizer: Any, ids: numpy.ndarray) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_matches_the_tokenizer_on_text_split_characters_and_unknown_ids(tiny_tokenizer: Any) -> None:
    decoder = ByteLevelDecoder.for_tokenizer(tiny_tokenizer)
    assert decoder is not None
    ids = numpy.array(tiny_tokenizer.encode(TEXT, add_special_tokens=False), dtype=numpy.int32)
    assert decoder.decode(ids) == own_decode(tiny_tokenizer, ids) == TEXT
    for end in range(len(ids)):  # every prefix: multi-byte characters cut at every byte
        assert decoder.decode(ids[:end]) == own_decode(tiny_tokenizer, ids[:end])
    size = len(tiny_tokenizer)
    rng = numpy.random.default_rng(7)
    for _ in range(50):  # random ids, unknown ones (>= the vocabulary) included
        ids = rng.integers(0, size + 100, 300).astype(numpy.int32)
        assert decoder.decode(ids) == own_decode(tiny_tokenizer, ids)
    assert decoder.decode(numpy.array([], dtype=numpy.int32)) == ""


def test_the_reward_tiers_file_tokenizer_gets_the_same_decoder(tiny_model_dir: Path, tiny_tokenizer: Any) -> None:
    """The reward tier loads ``tokenizer.json`` without transformers: its table is the one
    transformers' tokenizer gets, and it decodes as transformers does."""
    files = load_tokenizer(tiny_model_dir)
    assert isinstance(files, FileTokenizer)
    ours, theirs = ByteLevelDecoder.for_tokenizer(files), ByteLevelDecoder.for_tokenizer(tiny_tokenizer)
    assert ours is not None and theirs is not None
    ids = numpy.array(tiny_tokenizer.encode(TEXT, add_special_tokens=False), dtype=numpy.int32)
    assert ours.decode(ids) == theirs.decode(ids) == files.decode(ids) == TEXT


def test_no_decoder_for_tokenizers_it_cannot_match(tiny_model_dir: Path) -> None:
    assert ByteLevelDecoder.for_tokenizer(make_tokenizer()) is None  # word-level: no ByteLevel decoder
    added = AutoTokenizer.from_pretrained(tiny_model_dir)
    added.add_tokens(["ñandú"])  # its text is also byte-level alphabet: versions decode it differently
    assert ByteLevelDecoder.for_tokenizer(added) is None
    cleaning = AutoTokenizer.from_pretrained(tiny_model_dir)
    cleaning.clean_up_tokenization_spaces = True
    assert ByteLevelDecoder.for_tokenizer(cleaning) is None


class OffByOne:
    """The tiny tokenizer with a decode that differs from the byte-level rule on one id."""

    def __init__(self, tokenizer: Any, odd: int) -> None:
        self.tokenizer, self.odd = tokenizer, odd
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.clean_up_tokenization_spaces = False

    def decode(self, ids: Any, **kw: Any) -> str:
        return self.tokenizer.decode([i for i in numpy.asarray(ids).tolist() if i != self.odd], **kw)


@pytest.mark.parametrize("odd", [5, 300])
def test_a_decode_that_differs_anywhere_is_not_replaced(tiny_tokenizer: Any, odd: int) -> None:
    assert ByteLevelDecoder.for_tokenizer(OffByOne(tiny_tokenizer, odd)) is None

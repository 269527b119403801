"""An exact, faster ``decode`` for byte-level BPE tokenizers (the GPT-2, Qwen and Llama 3 families).

Such a tokenizer decodes ids by mapping each token's string back to bytes through the fixed
byte-to-unicode alphabet of its ``ByteLevel`` decoder (a token with a character outside that
alphabet, like an added token's text, stands for its own UTF-8 bytes), joining the bytes, and
reading them as UTF-8 with every invalid sequence replaced by U+FFFD. With each id's bytes in
a table that is a lookup and a join: about 6x faster than the tokenizer's own decode for 1,536
ids, which was the largest part of the reward worker's work per episode (bench/README.md).

:meth:`ByteLevelDecoder.for_tokenizer` builds one only for a tokenizer whose decode it has shown
to reproduce: a tokenizer whose ``backend_tokenizer`` (a ``tokenizers.Tokenizer``: transformers'
fast tokenizers and ``rollstream.tokenizer_file.FileTokenizer`` have one) decodes with exactly
``ByteLevel`` and which cleans up no tokenization spaces; then its decode of the whole vocabulary in random orders and of
random sequences (which split multi-byte characters, so invalid UTF-8 is checked too) must be
identical. Otherwise it returns None and callers keep the tokenizer's own decode.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy

log = logging.getLogger(__name__)

CHECK_SEED = 20_260_517
CHECK_SEQUENCES = 64  # random sequences compared besides the whole vocabulary
CHECK_LENGTH = 257
MAX_ID = 2**32 - 1  # the tokenizer takes ids as u32


class ByteLevelDecoder:
    """``decode(ids)``: what ``tokenizer.decode(ids, skip_special_tokens=False)`` returns (ids
    past the vocabulary decode to nothing, as there)."""

    def __init__(self, token_bytes: list[bytes], fallback: Any) -> None:
        # one more entry, b"": ids past the vocabulary decode to nothing, as in the tokenizer
        self._table = numpy.array([*token_bytes, b""], dtype=object)  # 1-D: numpy keeps bytes whole
        self._fallback = fallback  # the tokenizer, for ids outside the table

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> ByteLevelDecoder | None:
        """A decoder proven equal to ``tokenizer``'s on the checks above, or None."""
        token_bytes = _token_bytes(tokenizer)
        if token_bytes is None:
            return None
        decoder = cls(token_bytes, tokenizer)
        mismatch = decoder._first_mismatch(tokenizer)
        if mismatch is not None:
            log.info("the tokenizer's own decode is used: the byte-level table differs on %s", mismatch)
            return None
        return decoder

    def decode(self, ids: numpy.ndarray) -> str:
        """The text of a 1-D integer array of token ids (special tokens kept)."""
        if len(ids) == 0:
            return ""
        if int(ids.min()) < 0 or int(ids.max()) > MAX_ID:  # not token ids: the tokenizer's error
            return self._fallback.decode(ids, skip_special_tokens=False)
        return b"".join(self._table.take(ids, mode="clip").tolist()).decode("utf-8", "replace")

    def _first_mismatch(self, tokenizer: Any) -> str | None:
        rng = numpy.random.default_rng(CHECK_SEED)
        size = len(self._table)  # the vocabulary and one unknown id
        samples = [rng.permutation(size) for _ in range(2)]
        samples += [rng.integers(0, size + 16, CHECK_LENGTH) for _ in range(CHECK_SEQUENCES)]
        for ids in samples:
            if self.decode(ids) != tokenizer.decode(ids, skip_special_tokens=False):
                return f"a sequence of {len(ids)} ids"
        return None


def _token_bytes(tokenizer: Any) -> list[bytes] | None:
    """Each id's bytes, or None when ``tokenizer`` is not a plain byte-level one."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder) is not decoders.ByteLevel:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    byte_of = {char: byte for byte, char in _bytes_to_unicode().items()}

    def as_bytes(token: str) -> bytes:
        if all(char in byte_of for char in token):
            return bytes(byte_of[char] for char in token)
        return token.encode("utf-8")  # what ByteLevel does with a token outside its alphabet

    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    if any(as_bytes(text) != text.encode("utf-8") for text in added.values()):
        return None  # tokenizers versions differ on whether added tokens go through ByteLevel
    size = max([*backend.get_vocab(with_added_tokens=True).values(), -1]) + 1
    table = []
    for i in range(size):
        token = backend.id_to_token(i)
        table.append(b"" if token is None else as_bytes(token))  # unknown ids decode to nothing
    return table


def _bytes_to_unicode() -> dict[int, str]:
    """The ``ByteLevel`` alphabet (GPT-2's): printable bytes stand for themselves, the others
    for the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars

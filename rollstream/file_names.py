"""File names made from ids: an id names its file as it is when it is plain, else escaped.

A plain name (:func:`is_plain_name`) is not empty, at most :data:`MAX_NAME_BYTES` UTF-8 bytes,
holds no ``/``, ``%`` or control character and does not start with ``.``. Any other id is
percent-encoded (:func:`file_stem`), so the name can neither leave its directory nor collide
with another id's, and ``urllib.parse.unquote`` gives the id back; an id too long for a file
name is cut and gets ``%%`` plus 16 hex digits of its SHA-256.
"""

from __future__ import annotations

import hashlib

MAX_NAME_BYTES = 200  # below Linux's 255-byte NAME_MAX, with room for a suffix and temp names
_DIGEST_HEX = 16


def _needs_escape(char: str, index: int) -> bool:
    code = ord(char)
    return char in "/%" or code < 0x20 or code == 0x7F or (index == 0 and char == ".")


def is_plain_name(text: str) -> bool:
    """True when ``text`` can name a file as it is: not empty, at most 200 UTF-8 bytes, no
    ``/``, ``%`` or control character, and not starting with ``.`` (so never ``.`` or ``..``)."""
    return (
        bool(text)
        and len(text.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES
        and not any(_needs_escape(char, i) for i, char in enumerate(text))
    )


def file_stem(task_id: str) -> str:
    """The file name (without its suffix) of ``task_id``: the id itself when it is plain, else
    its percent-encoding, cut and suffixed with a digest when too long (module docstring)."""
    if is_plain_name(task_id):
        return task_id
    encoded = "".join(
        "".join(f"%{b:02X}" for b in char.encode("utf-8", "surrogatepass")) if _needs_escape(char, i) else char
        for i, char in enumerate(task_id)
    )
    if encoded and len(encoded.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES:
        return encoded
    digest = hashlib.sha256(task_id.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_HEX]
    return f"{_cut(encoded, MAX_NAME_BYTES - _DIGEST_HEX - 2)}%%{digest}"


def _cut(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes, never inside a character or an escape."""
    out, size = [], 0
    for char in text:
        size += len(char.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            break
        out.append(char)
    cut = "".join(out)
    tail = cut[-2:]
    if tail.endswith("%"):
        return cut[:-1]
    if tail.startswith("%"):
        return cut[:-2]
    return cut

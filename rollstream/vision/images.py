"""Images as the pipeline carries them: encoded image files (PNG, JPEG, ...) as bytes.

A data row may give an image in any of the forms AReaL's datasets use; every
tier turns it into the same thing, the bytes of an image file, with :func:`image_bytes`:

* ``bytes`` (or ``bytearray``/``memoryview``): an encoded image file, taken as is;
* a ``PIL.Image.Image``: encoded as PNG (lossless, so the trainer sees the rollout's pixels);
* a ``str``: a ``data:image/...;base64,`` URI, a path to an existing file, or plain base64;
* a ``dict`` with ``"bytes"`` (or else ``"path"``): the Hugging Face ``datasets`` Image form.

Callers may rely on: the result opens with PIL (else :class:`ImageError` naming what was
given); the same input gives the same bytes; :func:`image_digest` names an image by content,
so two samples that show the same picture name it alike. URLs are refused (no network is
assumed): download them into the dataset first.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

IMAGES_KEY = "images"  # where a prompt's images live in its data row (as in AReaL)
DIGEST_CHARS = 32  # hex characters of sha256 kept: 128 bits name an image


class ImageError(ValueError):
    """Something given as an image that is not one; the message says what was found."""


def image_list(value: Any) -> list[Any]:
    """``data["images"]`` as a list: ``None`` -> ``[]``, one image -> ``[image]``, a list or
    tuple -> a list of its items."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def image_bytes(image: Any, where: str = "image") -> bytes:
    """The encoded image file of ``image`` (see the module docstring); ``where`` names it in
    errors (e.g. ``"data['images'][1]"``). Raises :class:`ImageError`."""
    data = _raw_bytes(image, where)
    check_image(data, where)
    return data


def _raw_bytes(image: Any, where: str) -> bytes:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, str):
        return _string_bytes(image, where)
    if isinstance(image, Mapping):
        return _dataset_dict_bytes(image, where)
    if _is_pil(image):
        return _png(image)
    raise ImageError(
        f"{where} is a {type(image).__name__}; expected image bytes, a PIL image, a file path, "
        "base64 text or a data URI"
    )


def _string_bytes(text: str, where: str) -> bytes:
    if text.startswith("data:"):
        header, _, payload = text.partition(",")
        if ";base64" not in header:
            raise ImageError(f"{where} is a data URI without ';base64'; expected data:image/...;base64,...")
        return _b64decode(payload, where)
    if text.startswith(("http://", "https://")):
        raise ImageError(f"{where} is a URL ({text[:60]}); rollstream reads no network: store the image in the dataset")
    if len(text) < 4096 and Path(text).is_file():
        return Path(text).read_bytes()
    return _b64decode(text, where)


def _b64decode(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        shown = text[:60] + ("..." if len(text) > 60 else "")
        raise ImageError(f"{where} is neither an existing file nor base64 image data: {shown!r}") from None


def _dataset_dict_bytes(image: Mapping[str, Any], where: str) -> bytes:
    if image.get("bytes") is not None:
        return _raw_bytes(image["bytes"], where)
    if image.get("path"):
        return _raw_bytes(str(image["path"]), where)
    raise ImageError(f"{where} is a dict with keys {sorted(map(str, image))}; expected 'bytes' or 'path' (datasets' Image form)")


def _is_pil(image: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - PIL comes with transformers' image extras
        return False
    return isinstance(image, Image.Image)


def _png(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def check_image(data: bytes, where: str = "image") -> None:
    """``ImageError`` unless ``data`` is an image file PIL can read (only its header is read)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.size  # noqa: B018 - the header parse is the check
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageError(f"{where} ({len(data)} bytes) is not an image PIL can read: {exc}") from None


def open_image(data: bytes) -> Any:
    """``data`` as a loaded ``PIL.Image.Image`` (pixels read, file closed)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        img.load()
        return img


def to_base64(data: bytes) -> str:
    """Plain base64 text of ``data``: the form SGLang's ``image_data`` takes (and the HF engine)."""
    return base64.b64encode(data).decode("ascii")


def image_digest(data: bytes) -> str:
    """A content name for an image: the first 32 hex characters of its sha256."""
    return hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]

"""The images of an episode: which ones each row shows, and sending each once per group.

What a row shows is what the model saw: the ``image_data`` of the episode's engine calls
(``EpisodeEngine.image_data``), decoded to the encoded image files and named by content
(``rollstream.vision.image_digest``). The workflow's own vision inputs (``pixel_values``...)
never travel; the trainer side rebuilds them from these images.

Rules (:func:`episode_images`): an interactions result gives each row its call's images; a
tensor result gives every row the images of its calls, which must all have sent the same ones
(``ValueError`` otherwise: which row saw which cannot be told). When the result describes its
vision inputs (``multi_modal_input``), each row's image count must match.

:class:`ImageLedger` (one per run of a prompt): an episode carries the bytes only of images no
earlier message of the run carried; its lock makes "carried first" mean "queued first" (one
producer, one partition per task: the broker stores them in that order), so the bytes reach
the ``episodes`` partition before (or with) any episode that only names them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from rollstream.api.workflow import is_interactions
from rollstream.vision.images import image_bytes, image_digest
from rollstream.vision.inputs import result_image_counts
from rollstream.wire import Episode


class EpisodeImages(NamedTuple):
    row_images: list[list[str]]  # per row: digests in slot order ([] for a text episode)
    images: dict[str, bytes]  # every image the rows show, by digest


NO_IMAGES = EpisodeImages([], {})


def episode_images(result: Any, rows: int, sent: Sequence[Sequence[Any]]) -> EpisodeImages:
    """The images of an episode with ``rows`` trajectory rows whose engine calls sent ``sent``
    (see the module docstring). Raises ``ValueError`` (also ``ImageError``) naming the problem."""
    decoded: dict[str, tuple[str, bytes]] = {}
    if is_interactions(result):
        per_row = [_named(list(i.request.image_data or []), decoded) for i in result.values()]
    else:
        lists = [_named(list(images), decoded) for images in sent if images]
        if any(other != lists[0] for other in lists[1:]):
            raise ValueError(
                f"the episode's {len(lists)} engine calls sent different images and its result has "
                "no per-call rows: return a dict of Interaction (one row per call) instead"
            )
        per_row = [lists[0] if lists else [] for _ in range(rows)]
    if not any(per_row):
        return NO_IMAGES
    _check_counts(result, per_row)
    return EpisodeImages(per_row, {digest: data for digest, data in decoded.values()})


def _named(images: list[Any], decoded: dict[str, tuple[str, bytes]]) -> list[str]:
    """Digests of ``images`` (image_data entries); ``decoded`` caches each entry's bytes."""
    digests = []
    for index, entry in enumerate(images):
        key = entry if isinstance(entry, str) else repr(id(entry))
        if key not in decoded:
            data = image_bytes(entry, f"image_data[{index}]")
            decoded[key] = (image_digest(data), data)
        digests.append(decoded[key][0])
    return digests


def _check_counts(result: Any, per_row: list[list[str]]) -> None:
    counts = result_image_counts(result) if isinstance(result, dict) else None
    if counts is None or len(counts) != len(per_row):
        return
    for row, (count, shown) in enumerate(zip(counts, per_row)):
        if count != len(shown):
            raise ValueError(
                f"row {row}: the workflow's vision inputs hold {count} images but its engine calls sent "
                f"{len(shown)}; the trainer side rebuilds the vision inputs from the images the engine saw"
            )


class ImageLedger:
    """Which images a run of one prompt has sent. Hold ``lock`` from :meth:`unsent` until the
    send of the episode was queued, then :meth:`mark` what it carried."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self._sent: set[str] = set()

    def unsent(self, episode: Episode) -> Episode:
        """``episode`` carrying only the images not sent yet."""
        new = {d: data for d, data in episode.images.items() if d not in self._sent}
        return episode if len(new) == len(episode.images) else msgspec.structs.replace(episode, images=new)

    def mark(self, episode: Episode) -> None:
        """The images ``episode`` carries are sent (its send was queued)."""
        self._sent.update(episode.images)

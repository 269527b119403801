"""The grouping tier's intake check of an episode's weight versions.

An episode's versions decide its staleness, its group's trainer version and which weights the
trainer thinks produced each token, so the grouping tier refuses an episode whose versions
cannot be true (:class:`EpisodeRefused`: the record is dead-lettered with the reason, its
sample counts as failed, and its group goes on with the others):

* a version below -1 anywhere (-1 marks prompt positions, padding and "unknown");
* ``head_version``/``tail_version`` that are not a span: both -1, or ``0 <= head <= tail``;
* a generated token (:func:`rollstream.trajectory.staleness.row_spans`) whose known version
  lies outside ``[head_version, tail_version]``, or known versions under a head of -1;
* a ``tail_version`` above the trainer's current version, as Redis answers it just then: a
  version is published before any token of it is made. Only a fresh answer that this instance
  can trust refuses (:attr:`VersionReading.known`: Redis answered, and not below what it said
  before); a failed read or a version that went back accepts, as before (the group's trainer
  version is then raised to its tokens', ``group_trainer_version``).
"""

from __future__ import annotations

from typing import Any

import numpy

from rollstream.trajectory.staleness import PROMPT_VERSION, head_and_tail, row_spans
from rollstream.wire import Episode
from rollstream.wire.tensor_codec import decode_array

SHOWN = 5  # positions named in a reason


class EpisodeRefused(ValueError):
    """An episode whose versions cannot be true; ``reason`` says why (the dead letter's)."""

    def __init__(self, episode: Episode, reason: str) -> None:
        super().__init__(reason)
        self.reason = f"task {episode.task_id} sample {episode.sample_idx}: {reason}"
        self.episode = episode


def version_problem(episode: Episode) -> str | None:
    """What is impossible about ``episode``'s versions on their own; None when nothing is."""
    head, tail = episode.head_version, episode.tail_version
    if not (head == tail == PROMPT_VERSION or 0 <= head <= tail):
        return f"head_version {head} and tail_version {tail} are not a span (both -1, or 0 <= head <= tail)"
    arrays = _arrays(episode.trajectory)
    versions = arrays.get("versions")
    if versions is None:
        return None
    below = numpy.argwhere(versions < PROMPT_VERSION)
    if below.size:
        shown = [[int(i) for i in at] for at in below[:SHOWN]]
        return (f"token version {int(versions[tuple(below[0])])} is below -1 at [row, position] {shown} "
                "(-1 marks prompts and unknown versions; weight versions start at 0)")
    known = head_and_tail(row_spans(arrays))
    if known.head_version >= 0 and (head < 0 or known.head_version < head or known.tail_version > tail):
        return (f"its generated tokens carry versions {known.head_version}..{known.tail_version}, outside the "
                f"head_version..tail_version {head}..{tail} it claims")
    return None


def above_trainer(episode: Episode, trainer_version: int) -> str | None:
    """The reason to refuse ``episode`` when the trainer's current version (a trusted, fresh
    answer) is ``trainer_version``; None when its tokens are not newer."""
    if episode.tail_version <= trainer_version:
        return None
    return (f"tail_version {episode.tail_version} is above the trainer's current version {trainer_version} "
            "(a version is published before any token of it is made)")


def _arrays(trajectory: dict[str, Any]) -> dict[str, numpy.ndarray]:
    """The arrays :func:`row_spans` reads (the wire decoder checked shapes and dtypes)."""
    return {key: decode_array(trajectory[key])
            for key in ("input_ids", "attention_mask", "loss_mask", "versions") if key in trajectory}

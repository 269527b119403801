"""Turning ended groups into ``batches`` records: pure functions, no I/O, no torch.

:func:`build_emitted_group` pads the trajectories of one complete group (one ``batches`` record per
group) into one ``[N, L]`` array dict (``versions`` pad with -1, ``attention_mask`` with 0, the rest with
``pad_value``), adds ``rewards`` ``[N]``, the version bookkeeping the trainer needs and how
many samples were rejected and how many failed; for a group with images, its distinct images
once and, per row, which of them it shows. The
padded arrays are written straight into one buffer (an arena) that the record then carries
as its ``packed`` tensors, so encoding the record copies its bytes once. Everything here is
numpy (``rollstream.trajectory``): the grouping tier never imports torch.
"""

from __future__ import annotations

import logging
import time

import numpy

from rollstream.consumers.grouping.groups import CompleteGroup, DroppedGroup
from rollstream.trajectory.padding import align_keys, concat_padded_arrays
from rollstream.trajectory.staleness import group_trainer_version, staleness
from rollstream.wire import EmittedGroup, GroupDropped, ScoredEpisode, decode_arrays, pack_arrays
from rollstream.wire.dtypes import to_float32

log = logging.getLogger(__name__)

__all__ = ["align_keys", "build_emitted_group", "drop_record", "episode_rows", "group_images"]


def episode_rows(scored: ScoredEpisode) -> dict[str, numpy.ndarray]:
    """The ``[b, L]`` trajectory of one scored episode (arrays viewing the record's buffer)
    with ``rewards`` ``[b]`` float32.

    The trajectory's own ``rewards`` are kept (as float32) when they have the right shape;
    otherwise every row gets the scalar ``reward``.
    """
    rows = decode_arrays(scored.episode.trajectory)
    b = rows["input_ids"].shape[0]
    rewards = rows.get("rewards")
    if rewards is None or rewards.shape != (b,):
        rows["rewards"] = numpy.full((b,), float(scored.reward), dtype=numpy.float32)
    else:
        rows["rewards"] = to_float32(rewards)
    return rows


def build_emitted_group(group: CompleteGroup, trainer_version: int, pad_value: float = 0.0, version_known: bool = True) -> EmittedGroup:
    """The ``EmittedGroup`` record of one complete group.

    ``trainer_version`` (``version_known``: read from Redis just now) is what the grouping tier
    knows of the trainer. The record's head and tail are the group's (its episodes' spans
    combined, ``rollstream.trajectory.staleness.head_and_tail``: the numbers the staleness
    filter judged). The record is never tagged older than its newest token
    (``group_trainer_version``: a version was published before any token of it was generated,
    so a tail above ``trainer_version`` proves the trainer was at least there); it then
    carries the tail with ``trainer_version_known`` False, and its staleness is never negative.
    """
    parts: list[dict[str, numpy.ndarray]] = []
    sample_idx: list[int] = []
    for scored in group.episodes:
        rows = episode_rows(scored)
        parts.append(rows)
        sample_idx += [scored.episode.sample_idx] * rows["input_ids"].shape[0]
    images, row_images = group_images(group)
    arrays = concat_padded_arrays(align_keys(parts, pad_value), pad_value)
    head, tail = group.versions
    tagged = group_trainer_version(trainer_version, tail)
    return EmittedGroup(
        task_id=group.task_id,
        group_size=group.group_size,
        sample_idx=sample_idx,
        packed=pack_arrays(arrays),  # no copy: the arrays lie in one arena
        is_eval=group.is_eval,
        trainer_version=tagged,
        trainer_version_known=version_known and tagged == trainer_version,
        head_version=head,
        tail_version=tail,
        staleness=staleness(tagged, head),
        emitted_at=time.time(),
        rejected=group.rejected,
        failed=group.failed,
        images=images,
        row_images=row_images,
    )


def group_images(group: CompleteGroup) -> tuple[list[bytes], list[list[int]]]:
    """``(images, row_images)`` of a group's record (``EmittedGroup``'s fields): its distinct images
    once, in first-use order, and per row the indexes of those it shows. Empty lists for a
    text group."""
    if not group.images:
        return [], []
    index: dict[str, int] = {}
    row_images: list[list[int]] = []
    for scored in group.episodes:
        rows = scored.episode.row_images or [[] for _ in range(scored.episode.trajectory["input_ids"].shape[0])]
        for shown in rows:
            row_images.append([index.setdefault(d, len(index)) for d in shown])
    return [group.images[d] for d in index], row_images


def drop_record(group: DroppedGroup, trainer_version: int) -> GroupDropped:
    """The ``dropped`` record announcing ``group``'s end."""
    return GroupDropped(
        task_id=group.task_id,
        reason=group.reason,
        is_eval=group.is_eval,
        detail=group.detail,
        trainer_version=trainer_version,
        dropped_at=time.time(),
    )

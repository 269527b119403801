"""Turning ended groups into ``batches`` records: pure functions, no I/O, no torch.

:func:`build_batch` pads the trajectories of one or more complete groups into one ``[N, L]``
array dict (``versions`` pad with -1, ``attention_mask`` with 0, the rest with
``pad_value``), adds ``rewards`` ``[N]``, the version bookkeeping the trainer needs and, per
group, how many samples were rejected and how many failed; for groups with images, each
group's distinct images once and, per row, which of them it shows. The
padded arrays are written straight into one buffer (an arena) that the record then carries
as its ``packed`` tensors, so encoding the batch copies its bytes once. Everything here is
numpy (``rollstream.trajectory``): the grouping tier never imports torch.
"""

from __future__ import annotations

import logging
import time

import numpy

from rollstream.consumers.grouping import CompleteGroup, DroppedGroup
from rollstream.trajectory.padding import align_keys, concat_padded_arrays
from rollstream.trajectory.versions import batch_trainer_version, head_and_tail, staleness
from rollstream.wire import Batch, GroupDropped, ScoredEpisode, decode_arrays, pack_arrays
from rollstream.wire.dtypes import to_float32

log = logging.getLogger(__name__)

__all__ = ["align_keys", "batch_images", "build_batch", "drop_record", "episode_rows"]


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


def build_batch(
    groups: list[CompleteGroup], trainer_version: int, pad_value: float = 0.0, version_known: bool = True,
) -> Batch:
    """One ``Batch`` record for ``groups`` (all train or all eval; at least one group).

    ``trainer_version`` (``version_known``: read from Redis just now) is what the grouping tier
    knows of the trainer. The batch's head and tail are its groups' (their episodes' spans
    combined, ``rollstream.trajectory.versions.head_and_tail``: the numbers the staleness
    filter judged). The batch is never tagged older than its newest token
    (``batch_trainer_version``: a version was published before any token of it was generated,
    so a tail above ``trainer_version`` proves the trainer was at least there); the batch then
    carries the tail with ``trainer_version_known`` False, and its staleness is never negative.
    """
    if not groups:
        raise ValueError("build_batch needs at least one group")
    if len({g.is_eval for g in groups}) > 1:
        raise ValueError("build_batch: eval and train groups must not share a batch")
    parts: list[dict[str, numpy.ndarray]] = []
    row_task: list[int] = []
    sample_idx: list[int] = []
    for index, group in enumerate(groups):
        for scored in group.episodes:
            rows = episode_rows(scored)
            b = rows["input_ids"].shape[0]
            parts.append(rows)
            row_task += [index] * b
            sample_idx += [scored.episode.sample_idx] * b
    group_images, row_images = batch_images(groups)
    arrays = concat_padded_arrays(align_keys(parts, pad_value), pad_value)
    head, tail = head_and_tail(group.versions for group in groups)
    tagged = batch_trainer_version(trainer_version, tail)
    return Batch(
        task_ids=[g.task_id for g in groups],
        group_sizes=[g.group_size for g in groups],
        row_task=row_task,
        sample_idx=sample_idx,
        packed=pack_arrays(arrays),  # no copy: the arrays lie in one arena
        is_eval=groups[0].is_eval,
        trainer_version=tagged,
        trainer_version_known=version_known and tagged == trainer_version,
        head_version=head,
        tail_version=tail,
        staleness=staleness(tagged, head),
        emitted_at=time.time(),
        rejected=[g.rejected for g in groups],
        failed=[g.failed for g in groups],
        group_images=group_images,
        row_images=row_images,
    )


def batch_images(groups: list[CompleteGroup]) -> tuple[list[list[bytes]], list[list[int]]]:
    """``(group_images, row_images)`` of a batch (``Batch``'s fields): each group's distinct
    images once, in first-use order, and per row the indexes of those it shows. Empty lists
    when no group has images (a text batch)."""
    if not any(g.images for g in groups):
        return [], []
    group_images: list[list[bytes]] = []
    row_images: list[list[int]] = []
    for group in groups:
        index: dict[str, int] = {}
        for scored in group.episodes:
            rows = scored.episode.row_images or [[] for _ in range(scored.episode.trajectory["input_ids"].shape[0])]
            for shown in rows:
                row_images.append([index.setdefault(d, len(index)) for d in shown])
        group_images.append([group.images[d] for d in index])
    return group_images, row_images


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

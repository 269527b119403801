"""What a trainer step receives: ``batch_size`` groups padded into one ``[N, L]`` tensor dict.

Pure, no I/O: :func:`split_groups` cuts a ``Batch`` record into its groups, :func:`assemble`
pads groups from any number of records into one :class:`TrainingBatch`, and
:class:`BatchAccumulator` turns ``batches`` records into training batches with the offsets
that are safe to commit once the trainer has used them.

Vision: a group's images arrive once per group (``Batch.group_images``); each row says which it
shows. With an image processor (the model's, as in the rollout: ``trainer.processor_path``),
:func:`assemble` rebuilds the rows' ``pixel_values`` / ``image_grid_thw`` into
``TrainingBatch.vision`` (``rollstream.vision.inputs.VisionInputs``), each distinct image once.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from aiokafka.structs import ConsumerRecord, TopicPartition
from torch import Tensor

from consumers.batching import common_keys
from rollstream.vision.inputs import VisionInputs, build_vision_inputs
from rollstream.tensors import concat_padded_tensors, version_span
from rollstream.wire import Batch, GroupDropped, WireDecodeError, batch_tensors, decode_batch

log = logging.getLogger(__name__)


@dataclass
class GroupRows:
    """The rows of one group and where its record is (``offset`` in ``tp`` of ``batches``)."""

    task_id: str
    group_size: int
    is_eval: bool
    trainer_version: int
    tensors: dict[str, Tensor]
    sample_idx: list[int]
    tp: TopicPartition | None = None
    offset: int = -1
    rejected: int = 0  # samples the workflow rejected
    failed: int = 0  # samples that failed
    images: list[bytes] = field(default_factory=list)  # the group's distinct encoded images
    row_images: list[list[int]] = field(default_factory=list)  # per row: indexes into images ([] for text)


@dataclass
class TrainingBatch:
    """``batch_size`` groups for one trainer step.

    ``tensors`` are ``[N, L]`` (``rewards`` ``[N]``), padded across the groups: ``versions``
    with -1, ``attention_mask`` with 0, the rest with ``grouping.pad_value``; they are fresh,
    writable tensors. ``row_task[r]`` indexes ``task_ids`` for row r. ``trainer_versions`` and
    ``group_is_eval`` are per group, and so are ``group_rejected`` / ``group_failed``: how many
    samples of the group the workflow rejected / failed (0 for batches written before the
    grouping tier counted them). ``head_version``/``tail_version`` span every generated
    token (-1: none); ``max_staleness`` is the largest ``trainer_version - head`` of a group.
    ``offsets`` is what :meth:`BatchConsumer.ack` commits.

    Vision (empty for text): ``group_images[g]`` are group ``g``'s distinct encoded images;
    ``row_images[r]`` indexes those row ``r`` shows, in the order of its image slots;
    ``vision`` holds their ``pixel_values`` / ``image_grid_thw`` for a forward pass
    (``rollstream.vision.forward.trajectory_logits``) when the batch was assembled with an
    image processor, else ``None``.
    """

    tensors: dict[str, Tensor]
    task_ids: list[str]
    group_sizes: list[int]
    row_task: list[int]
    sample_idx: list[int]
    trainer_versions: list[int]
    group_is_eval: list[bool]
    head_version: int
    tail_version: int
    max_staleness: int
    offsets: dict[TopicPartition, int] = field(default_factory=dict)
    generation: int = 0
    group_rejected: list[int] = field(default_factory=list)
    group_failed: list[int] = field(default_factory=list)
    group_images: list[list[bytes]] = field(default_factory=list)
    row_images: list[list[int]] = field(default_factory=list)
    vision: VisionInputs | None = None

    @property
    def num_groups(self) -> int:
        return len(self.task_ids)

    @property
    def is_eval(self) -> bool:
        """True when every group is an eval group."""
        return bool(self.group_is_eval) and all(self.group_is_eval)


def split_groups(batch: Batch) -> list[GroupRows]:
    """The groups of a ``Batch`` record; ``ValueError`` if its bookkeeping is inconsistent."""
    tensors = batch_tensors(batch)
    n = tensors["input_ids"].shape[0] if "input_ids" in tensors else -1
    if len(batch.row_task) != n or len(batch.sample_idx) != n:
        raise ValueError(f"batch has {n} rows but {len(batch.row_task)} row_task entries")
    if len(batch.group_sizes) != len(batch.task_ids) or any(not 0 <= t < len(batch.task_ids) for t in batch.row_task):
        raise ValueError("batch row_task / group_sizes do not match its task_ids")
    groups = []
    for index, task_id in enumerate(batch.task_ids):
        rows = [r for r, t in enumerate(batch.row_task) if t == index]
        picked = torch.tensor(rows, dtype=torch.long)
        group_tensors = {k: v.index_select(0, picked) if v.dim() else v for k, v in tensors.items()}
        groups.append(GroupRows(
            task_id, batch.group_sizes[index], batch.is_eval, batch.trainer_version,
            group_tensors, [batch.sample_idx[r] for r in rows],
            rejected=_per_group(batch.rejected, index), failed=_per_group(batch.failed, index),
            images=list(batch.group_images[index]) if batch.group_images else [],
            row_images=[list(batch.row_images[r]) for r in rows] if batch.row_images else [],
        ))
    return groups


def _per_group(counts: list[int], index: int) -> int:
    return counts[index] if index < len(counts) else 0  # batches written before the counts: 0


def assemble(groups: list[GroupRows], pad_value: float = 0.0, image_processor: object = None) -> TrainingBatch:
    """Pad ``groups`` into one :class:`TrainingBatch` (``offsets`` left for the caller); with an
    ``image_processor``, also rebuild the rows' vision inputs."""
    if not groups:
        raise ValueError("assemble needs at least one group")
    parts = common_keys([g.tensors for g in groups])
    tensors = concat_padded_tensors(parts, pad_value) if len(parts) > 1 else {k: v.clone() for k, v in parts[0].items()}
    row_task = [i for i, g in enumerate(groups) for _ in g.sample_idx]
    head, tail = version_span(tensors.get("versions"))
    staleness = [g.trainer_version - h for g in groups if (h := version_span(g.tensors.get("versions"))[0]) >= 0]
    return TrainingBatch(
        tensors=tensors,
        task_ids=[g.task_id for g in groups],
        group_sizes=[g.group_size for g in groups],
        row_task=row_task,
        sample_idx=[s for g in groups for s in g.sample_idx],
        trainer_versions=[g.trainer_version for g in groups],
        group_is_eval=[g.is_eval for g in groups],
        head_version=head,
        tail_version=tail,
        max_staleness=max(staleness, default=0),
        group_rejected=[g.rejected for g in groups],
        group_failed=[g.failed for g in groups],
        **_vision_fields(groups, image_processor),
    )


def _vision_fields(groups: list[GroupRows], image_processor: object) -> dict[str, Any]:
    if not any(g.images for g in groups):
        return {}
    row_images = [row for g in groups for row in (g.row_images or [[] for _ in g.sample_idx])]
    fields: dict[str, Any] = {"group_images": [g.images for g in groups], "row_images": row_images}
    if image_processor is not None:
        shown = [[g.images[i] for i in row] for g in groups for row in (g.row_images or [[] for _ in g.sample_idx])]
        fields["vision"] = build_vision_inputs(image_processor, shown)
    return fields


class RecentTasks:
    """The task ids of the last ``capacity`` groups handed out, oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: dict[str, None] = {}

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._ids

    def add(self, task_id: str) -> None:
        self._ids.pop(task_id, None)
        self._ids[task_id] = None
        while len(self._ids) > self.capacity:
            del self._ids[next(iter(self._ids))]


class BatchAccumulator:
    """Collects groups record by record; hands out ``batch_size`` of them with commit offsets.

    ``batch.offsets`` covers every record taken so far, except a record whose groups were
    split across two batches: it is committed with the batch that uses its last group.

    Second line of defence against training on a group twice (the first is the pipeline's
    exactly-once emission): a group whose task id was handed out in the last
    ``remember_steps`` steps (e.g. re-delivered after a refused ack) is skipped and counted in
    ``duplicates_skipped``, never silently.
    """

    def __init__(
        self, batch_size: int, pad_value: float = 0.0, include_eval: bool = False, remember_steps: int = 64,
        image_processor: object = None,
    ) -> None:
        self.batch_size = batch_size
        self.pad_value = pad_value
        self.include_eval = include_eval
        self.image_processor = image_processor  # rebuilds vision inputs (None: images only as bytes)
        self._warned_images = False
        self.drops_by_reason: Counter[str] = Counter()
        self.undecodable = 0
        self.eval_skipped = 0
        self.duplicates_skipped = 0
        self.trained = RecentTasks(max(1, remember_steps) * batch_size)
        self._groups: list[GroupRows] = []
        self._progress: dict[TopicPartition, int] = {}  # next offset after the last record taken

    def ready(self) -> bool:
        return len(self._groups) >= self.batch_size

    def reset(self) -> None:
        """Forget what was taken but not handed out."""
        self._groups.clear()
        self._progress.clear()

    def take(self, record: ConsumerRecord) -> None:
        """Take one ``batches`` record: groups queue up, drops and bad records are counted."""
        tp = TopicPartition(record.topic, record.partition)
        self._progress[tp] = record.offset + 1
        try:
            message = decode_batch(record.value)
            groups = split_groups(message) if isinstance(message, Batch) else []
        except (WireDecodeError, ValueError) as exc:
            self.undecodable += 1
            log.warning("skipping undecodable batches record %s@%d: %s", tp, record.offset, exc)
            return
        if isinstance(message, GroupDropped):
            self.drops_by_reason[message.reason] += 1
            return
        if message.is_eval and not self.include_eval:
            self.eval_skipped += len(groups)
            return
        waiting = {g.task_id for g in self._groups}
        for group in groups:
            if group.task_id in self.trained or group.task_id in waiting:
                self.duplicates_skipped += 1
                log.warning("skipping group %s at %s@%d: already trained on (or waiting) in this run",
                            group.task_id, tp, record.offset)
                continue
            group.tp, group.offset = tp, record.offset
            self._groups.append(group)

    def hand_out(self) -> TrainingBatch:
        """The first ``batch_size`` waiting groups (call when :meth:`ready`)."""
        taken, self._groups = self._groups[: self.batch_size], self._groups[self.batch_size :]
        batch = assemble(taken, self.pad_value, self.image_processor)
        if batch.group_images and self.image_processor is None and not self._warned_images:
            self._warned_images = True
            log.warning("batches carry images but no image processor is set (trainer.processor_path): "
                        "TrainingBatch.vision is None; rebuild it with rollstream.vision.inputs.build_vision_inputs")
        for group in taken:
            self.trained.add(group.task_id)
        offsets = dict(self._progress)
        for left in self._groups:  # a record split across two batches is not committed yet
            if left.tp is not None:
                offsets[left.tp] = min(offsets.get(left.tp, left.offset), left.offset)
        batch.offsets = offsets
        return batch

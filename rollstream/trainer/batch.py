"""What a trainer step receives: groups padded into one ``[N, L]`` tensor dict.

Pure, no I/O: :func:`split_groups` cuts a ``Batch`` record into its groups and
:func:`assemble` pads groups from any number of records into one :class:`TrainingBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from aiokafka.structs import TopicPartition
from torch import Tensor

from rollstream.tensors import common_keys, concat_padded_tensors, version_span
from rollstream.wire import Batch, batch_tensors


@dataclass
class GroupRows:
    """The rows of one group and where its record is (``offset`` in ``partition`` of ``batches``;
    -1 when it came from elsewhere, e.g. a dump)."""

    task_id: str
    group_size: int
    is_eval: bool
    trainer_version: int
    tensors: dict[str, Tensor]
    sample_idx: list[int]
    partition: int = -1
    offset: int = -1
    rejected: int = 0  # samples of the group the workflow rejected
    failed: int = 0  # samples of the group that failed

    @property
    def tokens(self) -> int:
        """Attended positions over the group's rows (what a step's share is balanced on)."""
        mask = self.tensors.get("attention_mask")
        if mask is None:
            return int(self.tensors["input_ids"].numel())
        return int(mask.sum().item())


@dataclass
class TrainingBatch:
    """The groups of one trainer step (under ``torchrun``: this rank's share of them).

    ``tensors`` are ``[N, L]`` (``rewards`` ``[N]``), padded across the groups: ``versions``
    with -1, ``attention_mask`` with 0, the rest with ``grouping.pad_value``; they are fresh,
    writable tensors. ``row_task[r]`` indexes ``task_ids`` for row r. ``trainer_versions`` and
    ``group_is_eval`` are per group, and so are ``group_rejected`` / ``group_failed``: how many
    samples of the group the workflow rejected / failed (0 for batches written before the
    grouping tier counted them). ``head_version``/``tail_version`` span every generated
    token (-1: none); ``max_staleness`` is the largest ``trainer_version - head`` of a group.

    ``step`` counts the trainer's steps from 1, across restarts; ``rank``/``world_size`` say
    whose share this is (0/1 for a single process); ``step_groups`` is the number of groups in
    the whole step, every rank's share together. ``offsets`` is what committing the step
    commits (the next offset per partition); only the stream that handed the batch out uses it.
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
    step: int = 0
    rank: int = 0
    world_size: int = 1
    step_groups: int = 0
    group_rejected: list[int] = field(default_factory=list)
    group_failed: list[int] = field(default_factory=list)

    @property
    def num_groups(self) -> int:
        return len(self.task_ids)

    @property
    def is_eval(self) -> bool:
        """True when every group is an eval group."""
        return bool(self.group_is_eval) and all(self.group_is_eval)

    @property
    def tokens(self) -> int:
        """Attended positions over every row."""
        return int(self.tensors["attention_mask"].sum().item()) if "attention_mask" in self.tensors else 0


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
        ))
    return groups


def _per_group(counts: list[int], index: int) -> int:
    return counts[index] if index < len(counts) else 0  # batches written before the counts: 0


def assemble(groups: list[GroupRows], pad_value: float = 0.0) -> TrainingBatch:
    """Pad ``groups`` into one :class:`TrainingBatch` (``offsets`` and step fields left for
    the caller)."""
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
        step_groups=len(groups),
        group_rejected=[g.rejected for g in groups],
        group_failed=[g.failed for g in groups],
    )

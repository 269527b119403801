"""A step as a trainer receives it: its groups padded into one ``[N, L]`` tensor dict.

Pure, no I/O: :func:`emitted_group_rows` reads the rows of the group an ``EmittedGroup`` record carries (one group per record)
and :func:`assemble` pads groups from any number of records into one :class:`TrainingStep`.

Vision: a group's images arrive once per group (``EmittedGroup.images``); each row says which it
shows. With an image processor (the model's, as in the rollout: ``trainer.processor_path``,
:func:`trainer_image_processor`), :func:`assemble` rebuilds the rows' ``pixel_values`` /
``image_grid_thw`` into ``TrainingStep.vision`` (``rollstream.vision.inputs.VisionInputs``),
each distinct image once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiokafka.structs import TopicPartition
from torch import Tensor

from rollstream.trajectory.padding import align_keys, concat_padded_tensors
from rollstream.trajectory.staleness import head_and_tail, row_spans, staleness
from rollstream.config import RollstreamConfig
from rollstream.vision.inputs import VisionInputs, build_vision_inputs
from rollstream.wire import EmittedGroup
from rollstream.wire.torch_tensors import group_tensors


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
    images: list[bytes] = field(default_factory=list)  # the group's distinct encoded images
    row_images: list[list[int]] = field(default_factory=list)  # per row: indexes into images ([] for text)
    # False: trainer_version is not what Redis answered at emission (EmittedGroup.trainer_version_known)
    trainer_version_known: bool = True

    @property
    def head_version(self) -> int:
        """The version of the group's oldest generated token (-1: none known)."""
        return head_and_tail(row_spans(self.tensors)).head_version

    @property
    def tokens(self) -> int:
        """Attended positions over the group's rows (what a step's share is balanced on)."""
        mask = self.tensors.get("attention_mask")
        if mask is None:
            return int(self.tensors["input_ids"].numel())
        return int(mask.sum().item())


@dataclass
class TrainingStep:
    """The groups of one trainer step (under ``torchrun``: this rank's share of them).

    ``tensors`` are ``[N, L]`` (``rewards`` ``[N]``), padded across the groups: ``versions``
    with -1, ``attention_mask`` with 0, the rest with ``grouping.pad_value``; they are fresh,
    writable tensors. ``row_task[r]`` indexes ``task_ids`` for row r. ``trainer_versions`` and
    ``group_is_eval`` are per group (a group's trainer version is never older than its tokens;
    ``trainer_versions_known[g]`` False: it was not what Redis answered at emission, but the
    last version the grouping tier knew or the group's newest token's), and so are ``group_rejected`` / ``group_failed``: how many
    samples of the group the workflow rejected / failed (0 for groups emitted before the
    grouping tier counted them). ``head_version``/``tail_version`` span every generated
    token (-1: none) and ``max_staleness`` is the largest staleness of a group, by
    ``rollstream.trajectory.staleness`` (generated positions only, from the tensors: tokens the
    rollout worker versioned with its engine's version because the workflow gave none are
    unknown here).

    ``step`` counts the trainer's steps from 1, across restarts; ``rank``/``world_size`` say
    whose share this is (0/1 for a single process); ``step_groups`` is the number of groups in
    the whole step, every rank's share together. ``offsets`` is what committing the step
    commits (the next offset per partition); only the stream that handed the step out uses it.

    Vision (empty for text): ``group_images[g]`` are group ``g``'s distinct encoded images;
    ``row_images[r]`` indexes those row ``r`` shows, in the order of its image slots;
    ``vision`` holds their ``pixel_values`` / ``image_grid_thw`` for a forward pass
    (``rollstream.vision.forward.trajectory_logits``) when the step was assembled with an
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
    step: int = 0
    rank: int = 0
    world_size: int = 1
    step_groups: int = 0
    group_rejected: list[int] = field(default_factory=list)
    group_failed: list[int] = field(default_factory=list)
    group_images: list[list[bytes]] = field(default_factory=list)
    row_images: list[list[int]] = field(default_factory=list)
    vision: VisionInputs | None = None
    trainer_versions_known: list[bool] = field(default_factory=list)

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


def emitted_group_rows(group: EmittedGroup) -> GroupRows:
    """The rows of the one group an ``EmittedGroup`` record carries; ``ValueError`` if its
    bookkeeping is inconsistent."""
    tensors = group_tensors(group)
    n = tensors["input_ids"].shape[0] if "input_ids" in tensors else -1
    if len(group.sample_idx) != n:
        raise ValueError(f"group {group.task_id} has {n} rows but {len(group.sample_idx)} sample_idx entries")
    return GroupRows(
        group.task_id, group.group_size, group.is_eval, group.trainer_version, tensors, list(group.sample_idx),
        rejected=group.rejected, failed=group.failed, images=list(group.images),
        row_images=[list(r) for r in group.row_images], trainer_version_known=group.trainer_version_known,
    )


def assemble(groups: list[GroupRows], pad_value: float = 0.0, image_processor: Any = None) -> TrainingStep:
    """Pad ``groups`` into one :class:`TrainingStep` (``offsets`` and step fields left for
    the caller); with an ``image_processor``, also rebuild the rows' vision inputs."""
    if not groups:
        raise ValueError("assemble needs at least one group")
    tensors = concat_padded_tensors(align_keys([g.tensors for g in groups], pad_value), pad_value)
    versions = [head_and_tail(row_spans(g.tensors)) for g in groups]
    head, tail = head_and_tail(versions)
    return TrainingStep(
        tensors=tensors,
        task_ids=[g.task_id for g in groups],
        group_sizes=[g.group_size for g in groups],
        row_task=[i for i, g in enumerate(groups) for _ in g.sample_idx],
        sample_idx=[s for g in groups for s in g.sample_idx],
        trainer_versions=[g.trainer_version for g in groups],
        trainer_versions_known=[g.trainer_version_known for g in groups],
        group_is_eval=[g.is_eval for g in groups],
        head_version=head,
        tail_version=tail,
        max_staleness=max((staleness(g.trainer_version, v.head_version) for g, v in zip(groups, versions)), default=0),
        step_groups=len(groups),
        group_rejected=[g.rejected for g in groups],
        group_failed=[g.failed for g in groups],
        **_vision_fields(groups, image_processor),
    )


def _vision_fields(groups: list[GroupRows], image_processor: Any) -> dict[str, Any]:
    if not any(g.images for g in groups):
        return {}
    per_row = [(g, row) for g in groups for row in (g.row_images or [[] for _ in g.sample_idx])]
    fields: dict[str, Any] = {"group_images": [g.images for g in groups], "row_images": [row for _, row in per_row]}
    if image_processor is not None:
        fields["vision"] = build_vision_inputs(image_processor, [[g.images[i] for i in row] for g, row in per_row])
    return fields


def trainer_image_processor(config: RollstreamConfig) -> Any:
    """The image processor of ``trainer.processor_path``, or ``None`` when it is not set."""
    if not config.trainer.processor_path:
        return None
    from rollstream.vision.processor import load_image_processor

    return load_image_processor(config.trainer.processor_path)

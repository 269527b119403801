"""What rank 0 sends each rank per step: its share of the step's groups (MessagePack).

Tensors travel raw (dtype, shape, little-endian bytes) and are decoded without copying; the
receiving rank pads them into its own :class:`~rollstream.trainer.training_step.TrainingStep`.
``kind`` is ``step`` (a share), ``idle`` (no step yet: ask again) or ``stop`` (every rank
leaves its loop), so every rank takes the same decision in the same round.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from rollstream.trainer.training_step import GroupRows
from rollstream.wire import WireTensor
from rollstream.wire.torch_tensors import decode_tensor_dict, encode_tensor_dict

SHARE_SCHEMA_VERSION = 1


class ShareGroup(msgspec.Struct, array_like=True, frozen=True):
    task_id: str
    group_size: int
    is_eval: bool
    trainer_version: int
    sample_idx: list[int]
    partition: int
    offset: int
    tensors: dict[str, WireTensor]
    images: list[bytes] = []  # the group's encoded images, once (vision)
    row_images: list[list[int]] = []  # per row: indexes into images
    trainer_version_known: bool = True
    rejected: int = 0
    failed: int = 0


class StepShare(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's part of one round."""

    schema_version: int = SHARE_SCHEMA_VERSION
    kind: Literal["step", "idle", "stop"]
    step: int = 0
    rank: int = 0
    world_size: int = 1
    step_groups: int = 0
    groups: list[ShareGroup] = []
    error: str = ""  # kind "stop" because rank 0 failed: what happened


_decoder = msgspec.msgpack.Decoder(StepShare)


def encode_share(share: StepShare) -> bytes:
    return msgspec.msgpack.encode(share)


def decode_share(data: bytes) -> StepShare:
    share = _decoder.decode(data)
    if share.schema_version != SHARE_SCHEMA_VERSION:
        raise ValueError(f"step share schema {share.schema_version}, this rank reads {SHARE_SCHEMA_VERSION}: "
                         "every rank must run the same rollstream version")
    return share


def share_group(group: GroupRows) -> ShareGroup:
    return ShareGroup(group.task_id, group.group_size, group.is_eval, group.trainer_version, group.sample_idx,
                      group.partition, group.offset, encode_tensor_dict(group.tensors),
                      group.images, group.row_images, group.trainer_version_known, group.rejected, group.failed)


def group_rows(group: ShareGroup) -> GroupRows:
    return GroupRows(group.task_id, group.group_size, group.is_eval, group.trainer_version,
                     decode_tensor_dict(group.tensors), list(group.sample_idx), group.partition, group.offset,
                     rejected=group.rejected, failed=group.failed, images=list(group.images),
                     row_images=[list(r) for r in group.row_images], trainer_version_known=group.trainer_version_known)

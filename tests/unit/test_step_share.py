"""A rank's share of a step: every group field rank 0 knows reaches the other ranks."""

from __future__ import annotations

import dataclasses

import torch

from rollstream.trainer.ranks.share import StepShare, decode_share, encode_share, group_rows, share_group
from rollstream.trainer.training_step import GroupRows, assemble


def test_every_field_of_a_group_survives_the_share() -> None:
    # each field set away from its default, so a field the share forgets comes back different
    sent = GroupRows(
        "t:3", 4, True, 7, {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]), "rewards": torch.tensor([1.0, 0.0])},
        [0, 2], partition=3, offset=41, rejected=1, failed=1, images=[b"png"], row_images=[[0], []],
        trainer_version_known=False,
    )
    share = decode_share(encode_share(StepShare(kind="step", step=2, rank=1, world_size=2, groups=[share_group(sent)])))
    received = group_rows(share.groups[0])
    for field in dataclasses.fields(GroupRows):
        mine, theirs = getattr(sent, field.name), getattr(received, field.name)
        if field.name == "tensors":
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        else:
            assert theirs == mine, field.name
    step = assemble([received])  # what the user's train step sees on a rank other than 0
    assert (step.group_rejected, step.group_failed) == ([1], [1])

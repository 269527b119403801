"""Images once per group from the grouping buffer to the trainer side (no broker): carriers,
duplicates, waiting for bytes, the batch's fields, and the vision inputs a trainer receives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from harness.episodes import rejected, scored
from harness.images import noise_png
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.consumers.grouping.groups import CompleteGroup, DroppedGroup, GroupBuffer
from rollstream.trainer import assemble, emitted_group_rows
from rollstream.vision.images import image_digest
from rollstream.vision.inputs import build_vision_inputs
from rollstream.vision.processor import load_image_processor
from rollstream.wire import ScoredEpisode, WireDecodeError, decode_group, encode


CAT, DOG, OWL = noise_png(31), noise_png(32, 30, 50), noise_png(33, 60, 20)


def shows(message: ScoredEpisode, images: list[bytes], carry: list[bytes] = ()) -> ScoredEpisode:  # type: ignore[assignment]
    """``message`` whose one row shows ``images`` and which carries the bytes of ``carry``."""
    episode = msgspec.structs.replace(
        message.episode, row_images=[[image_digest(i) for i in images]], images={image_digest(i): i for i in carry},
    )
    return msgspec.structs.replace(message, episode=episode)


def buffer() -> GroupBuffer:
    return GroupBuffer(group_timeout_seconds=10.0, dedupe_window_seconds=100.0)


def test_a_group_gathers_each_image_once_from_whichever_message_carries_it() -> None:
    buf = buffer()
    messages = [shows(scored("t", 0), [CAT, DOG], [CAT, DOG]), rejected("t", 1),
                shows(scored("t", 2), [CAT, DOG]), shows(scored("t", 3), [CAT, DOG])]
    results = [r for offset, m in enumerate(messages) for r in buf.add(m, 0, offset, 0.0)]
    [group] = results
    assert isinstance(group, CompleteGroup) and group.images == {image_digest(CAT): CAT, image_digest(DOG): DOG}
    batch = build_emitted_group(group, trainer_version=1)
    assert batch.images == [CAT, DOG] and batch.row_images == [[0, 1], [0, 1], [0, 1]]
    assert decode_group(encode(batch)) == batch


def test_a_complete_group_waits_for_images_a_duplicate_carries() -> None:
    buf = buffer()
    # A re-run prompt: sample 0 first came without bytes (its run's carrier was lost with the
    # worker); the second run's carrier is a duplicate of sample 0, sent after every sample.
    for offset, idx in enumerate(range(4)):
        assert buf.add(shows(scored("t", idx), [OWL]), 0, offset, 0.0) == []
    [group] = buf.add(shows(scored("t", 0), [OWL], [OWL]), 0, 4, 0.0)
    assert isinstance(group, CompleteGroup) and group.images == {image_digest(OWL): OWL}
    assert len(group.episodes) == 4


def test_a_group_whose_images_never_arrive_times_out_saying_so() -> None:
    buf = buffer()
    for idx in range(4):
        buf.add(shows(scored("t", idx), [OWL]), 0, idx, 0.0)
    [drop] = buf.expire(now=11.0)
    assert isinstance(drop, DroppedGroup) and drop.reason == "timeout"
    assert "4 of 4 samples" in drop.detail and "1 of its images never arrived" in drop.detail


def test_a_batch_names_its_rows_images_and_a_text_batch_has_none() -> None:
    image_group = CompleteGroup("a", 2, False, (shows(scored("a", 0, 2), [DOG, CAT], [DOG, CAT]),
                                                 shows(scored("a", 1, 2), [CAT])), 0, 0, 0, 1, 0.0,
                                images={image_digest(CAT): CAT, image_digest(DOG): DOG})
    batch = build_emitted_group(image_group, trainer_version=2)
    assert batch.images == [DOG, CAT] and batch.row_images == [[0, 1], [1]]
    bad = msgspec.structs.replace(batch, row_images=[[0, 2], [1]])
    with pytest.raises(WireDecodeError, match=r"row 0 shows image \[0, 2\] but its group has 2 images"):
        decode_group(encode(bad))
    text_only = build_emitted_group(CompleteGroup("b", 1, False, (scored("b", 0, 1),), 0, 0, 0, 0, 0.0), trainer_version=2)
    assert text_only.images == [] and text_only.row_images == []


@pytest.fixture(scope="module")
def image_processor(tiny_vlm_dir: Path) -> Any:
    return load_image_processor(tiny_vlm_dir)


def test_the_trainer_side_rebuilds_each_rows_images_once_per_distinct_image(image_processor: Any) -> None:
    image_group = CompleteGroup("a", 3, False, tuple(
        shows(scored("a", i, 3), imgs, carry) for i, (imgs, carry) in enumerate([
            ([DOG, CAT], [DOG, CAT]), ([CAT], []), ([DOG, CAT], [])])), 0, 0, 0, 2, 0.0,
        images={image_digest(CAT): CAT, image_digest(DOG): DOG})
    text_group = CompleteGroup("b", 1, False, (scored("b", 0, 1),), 0, 0, 0, 0, 0.0)
    groups = [emitted_group_rows(build_emitted_group(image_group, 1)), emitted_group_rows(build_emitted_group(text_group, 1))]
    batch = assemble(groups, image_processor=image_processor)
    assert batch.group_images == [[DOG, CAT], []] and batch.row_images == [[0, 1], [1], [0, 1], []]
    vision = batch.vision
    assert vision is not None and vision.num_images == 2 and vision.row_images == [[0, 1], [1], [0, 1], []]
    expected = build_vision_inputs(image_processor, [[DOG], [CAT]])
    assert expected is not None
    torch.testing.assert_close(vision.pixel_values, expected.pixel_values)
    torch.testing.assert_close(vision.image_grid_thw, expected.image_grid_thw)
    second = vision.select([1, 3])  # a micro-batch keeps only what its rows show
    assert second.row_images == [[0], []] and torch.equal(second.pixel_values, vision.patches(1))
    assert assemble(groups).vision is None  # no image processor: only the bytes


def test_a_ranks_share_carries_its_groups_images() -> None:
    from rollstream.trainer.ranks.share import StepShare, decode_share, encode_share, group_rows, share_group

    group = CompleteGroup("a", 2, False, (shows(scored("a", 0, 2), [DOG, CAT], [DOG, CAT]),
                                         shows(scored("a", 1, 2), [CAT])), 0, 0, 0, 1, 0.0,
                          images={image_digest(CAT): CAT, image_digest(DOG): DOG})
    rows = emitted_group_rows(build_emitted_group(group, trainer_version=1))
    share = decode_share(encode_share(StepShare(kind="step", step=1, groups=[share_group(rows)])))
    received = group_rows(share.groups[0])
    assert received.images == [DOG, CAT] and received.row_images == [[0, 1], [1]]
    assert assemble([received]).row_images == [[0, 1], [1]]

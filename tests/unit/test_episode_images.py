"""Which images an episode's rows show, each image's bytes once per run of a prompt, and the
wire checks of the vision fields (no broker, no model)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from harness.images import noise_png
from rollstream.api.io_struct import ModelRequest, ModelResponse
from rollstream.api.workflow import Interaction
from rollstream.rollout_workers.episode_images import ImageLedger, episode_images
from rollstream.rollout_workers.episodes import to_episode
from rollstream.trajectory.rows import trajectory_row
from rollstream.vision.images import image_digest, to_base64
from rollstream.wire import Episode, PromptTask, SampleRejected, WireDecodeError, decode_episode, encode


CAT, DOG = noise_png(21), noise_png(22, 20, 30)
CAT_ID, DOG_ID = image_digest(CAT), image_digest(DOG)
TASK = PromptTask(task_id="p:0:1", group_size=4, data={"images": [CAT, DOG], "answer": "4"})


def row(out: int = 2) -> dict[str, torch.Tensor]:
    return trajectory_row([5, 6, 7], list(range(10, 10 + out)), [-0.5] * out, [0] * out)


def test_every_row_shows_what_the_calls_sent_and_data_leaves_the_images_out() -> None:
    sent = [[to_base64(CAT), to_base64(DOG)], [to_base64(CAT), to_base64(DOG)]]  # two turns, same images
    episode = to_episode(TASK, 1, row(), "stop", "w", image_data=sent)
    assert isinstance(episode, Episode)
    assert episode.row_images == [[CAT_ID, DOG_ID]] and episode.images == {CAT_ID: CAT, DOG_ID: DOG}
    assert episode.data == {"answer": "4"}  # the reward tier never gets the images
    assert decode_episode(encode(episode)) == episode
    text = to_episode(PromptTask(task_id="t", group_size=1, data={"answer": "4"}), 0, row(), "stop", "w")
    assert isinstance(text, Episode) and text.row_images == [] and text.images == {}


def test_calls_that_sent_different_images_need_per_call_rows() -> None:
    failed = to_episode(TASK, 0, row(), "stop", "w", image_data=[[to_base64(CAT)], [to_base64(DOG)]])
    assert isinstance(failed, SampleRejected) and failed.failed
    assert "engine calls sent different images" in failed.reason and "Interaction" in failed.reason
    calls = {
        str(i): Interaction(ModelRequest(input_ids=[5], image_data=images), ModelResponse([5], [9], [-0.1], [0]), 1.0)
        for i, images in enumerate([[to_base64(CAT)], [to_base64(DOG), to_base64(CAT)], None])
    }
    shown = episode_images(calls, 3, [])
    assert shown.row_images == [[CAT_ID], [DOG_ID, CAT_ID], []]


def test_the_workflows_vision_inputs_must_count_the_images_the_engine_saw() -> None:
    result = {**row(), "multi_modal_input": [{"pixel_values": torch.zeros(4, 8), "image_grid_thw": torch.ones(1, 3)}]}
    failed = to_episode(TASK, 0, result, "stop", "w", image_data=[[to_base64(CAT), to_base64(DOG)]])
    assert isinstance(failed, SampleRejected) and "vision inputs hold 1 images but its engine calls sent 2" in failed.reason
    ok = to_episode(TASK, 0, result, "stop", "w", image_data=[[to_base64(CAT)]])
    assert isinstance(ok, Episode) and "multi_modal_input" not in ok.trajectory


def test_a_run_of_a_prompt_sends_each_image_once() -> None:
    ledger = ImageLedger()
    first = to_episode(TASK, 0, row(), "stop", "w", image_data=[[to_base64(CAT)]])
    second = to_episode(TASK, 1, row(), "stop", "w", image_data=[[to_base64(CAT), to_base64(DOG)]])
    assert isinstance(first, Episode) and isinstance(second, Episode)
    carried = ledger.unsent(first)
    ledger.mark(carried)
    assert carried.images == {CAT_ID: CAT}
    carried = ledger.unsent(second)
    assert carried.images == {DOG_ID: DOG} and carried.row_images == [[CAT_ID, DOG_ID]]
    ledger.mark(carried)
    assert ledger.unsent(second).images == {}


def test_the_wire_refuses_inconsistent_image_fields() -> None:
    episode = to_episode(TASK, 0, row(), "stop", "w", image_data=[[to_base64(CAT)]])
    assert isinstance(episode, Episode)
    for bad, reason in [
        (msgspec.structs.replace(episode, row_images=[[CAT_ID], [CAT_ID]]), "row_images has 2 entries for 1"),
        (msgspec.structs.replace(episode, images={CAT_ID: DOG}), "do not match its digest"),
        (msgspec.structs.replace(episode, images={DOG_ID: DOG}), "no row shows it"),
    ]:
        with pytest.raises(WireDecodeError, match=reason):
            decode_episode(encode(bad))

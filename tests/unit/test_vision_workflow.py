"""VisionRLVRWorkflow with the tiny offline VLM and its processor: parity with the reference
(processor over images and chat, base64 image_data with placeholder ids, vision inputs in the
result), every image form of a data row, and clear refusals."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.images import noise_png
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.engines.hf import HFEngine
from rollstream.testing import check_workflow, workflow_processor, workflow_tokenizer
from rollstream.vision.images import ImageError, open_image
from rollstream.workflows.vision_rlvr import VisionRLVRWorkflow


pytestmark = pytest.mark.timeout(180)

CAT, DOG = noise_png(11), noise_png(12, 30, 90)


class RecordingEngine:
    """Answers every request with two tokens and keeps the requests (no model needed)."""

    def __init__(self) -> None:
        self.requests: list[ModelRequest] = []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(req)
        return ModelResponse(list(req.input_ids), [7, 8], [-0.5, -0.25], [3, 3], "stop")

    def get_version(self) -> int:
        return 3


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir: Path) -> Any:
    return workflow_processor(tiny_vlm_dir)


@pytest.fixture(scope="module")
def workflow(tiny_vlm_dir: Path, processor: Any) -> VisionRLVRWorkflow:
    tokenizer = workflow_tokenizer(tiny_vlm_dir)
    return VisionRLVRWorkflow(GenerationHyperparameters(max_new_tokens=6), tokenizer, processor)


def chat(images: int, text: str = "How many dots?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]


async def test_result_matches_the_reference_form(workflow: VisionRLVRWorkflow, processor: Any) -> None:
    engine = RecordingEngine()
    td = await workflow.arun_episode(engine, {"messages": chat(2), "images": [CAT, DOG]})
    expected = processor(images=[open_image(CAT), open_image(DOG)],
                         text=[processor.apply_chat_template(chat(2), add_generation_prompt=True, tokenize=False)],
                         return_tensors="pt")
    request = engine.requests[0]
    assert request.input_ids == expected["input_ids"][0].tolist()
    assert [base64.b64decode(i) for i in request.image_data or []] == [CAT, DOG]
    prompt_len = len(request.input_ids)
    assert td["input_ids"][0].tolist() == request.input_ids + [7, 8]
    assert td["loss_mask"][0].tolist() == [0] * prompt_len + [1, 1]
    assert td["versions"][0].tolist() == [-1] * prompt_len + [3, 3]
    [vision] = td["multi_modal_input"]
    torch.testing.assert_close(vision["pixel_values"], expected["pixel_values"])
    torch.testing.assert_close(vision["image_grid_thw"], expected["image_grid_thw"])


@pytest.mark.parametrize("form", ["bytes", "pil", "path", "base64", "data_uri", "dataset_dict"])
async def test_every_image_form_of_a_data_row_sends_the_same_image(
    workflow: VisionRLVRWorkflow, tmp_path: Path, form: str,
) -> None:
    path = tmp_path / "cat.png"
    path.write_bytes(CAT)
    text = base64.b64encode(CAT).decode()
    image = {"bytes": CAT, "pil": open_image(CAT), "path": str(path), "base64": text,
             "data_uri": f"data:image/png;base64,{text}", "dataset_dict": {"bytes": None, "path": str(path)}}[form]
    engine = RecordingEngine()
    await workflow.arun_episode(engine, {"messages": chat(1), "images": image})
    assert base64.b64decode(engine.requests[0].image_data[0]) == CAT  # type: ignore[index]


async def test_text_already_templated_and_text_only_prompts(workflow: VisionRLVRWorkflow, processor: Any) -> None:
    engine = RecordingEngine()
    text = processor.apply_chat_template(chat(1), add_generation_prompt=True, tokenize=False)
    td = await workflow.arun_episode(engine, {"messages": text, "images": [DOG]})
    assert "multi_modal_input" in td and engine.requests[0].image_data
    td = await workflow.arun_episode(engine, {"messages": [{"role": "user", "content": "What is 2+2?"}]})
    assert "multi_modal_input" not in td and engine.requests[1].image_data is None


async def test_slots_and_images_must_agree(workflow: VisionRLVRWorkflow) -> None:
    engine = RecordingEngine()
    with pytest.raises(ValueError, match="2 image slots .* for 1 images in data"):
        await workflow.arun_episode(engine, {"messages": chat(2), "images": [CAT]})
    with pytest.raises(ImageError, match=r"data\['images'\]\[0\] is neither an existing file nor base64"):
        await workflow.arun_episode(engine, {"messages": chat(1), "images": ["no such image"]})
    with pytest.raises(TypeError, match="needs the model's processor"):
        VisionRLVRWorkflow(GenerationHyperparameters(), workflow.tokenizer, None)
    assert engine.requests == []


async def test_check_workflow_runs_it_on_the_tiny_vlm(tiny_vlm_dir: Path, workflow: VisionRLVRWorkflow) -> None:
    engine = HFEngine(str(tiny_vlm_dir), seed=0)
    await engine.start()
    try:
        check = await check_workflow(workflow, {"messages": chat(2), "images": [CAT, DOG]}, n=3, engine=engine)
    finally:
        await engine.close()
    assert len(check.episodes) == 3
    for sample in check.episodes:  # the vision inputs never go on the wire
        assert "multi_modal_input" not in sample.tensors and sample.tensors["loss_mask"].sum() > 0

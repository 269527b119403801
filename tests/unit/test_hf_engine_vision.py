"""HFEngine with the tiny offline VLM: images in prefills, continuous batching with text rows,
interruptible generation across a weight update, refused requests, logprobs within 1e-4 of a
fresh forward pass with the same images."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.images import fresh_logprobs, image_data, noise_png, vision_prompt
from rollstream.api.engine import WeightUpdate
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.api.engine import InvalidRequestError
from rollstream.engines.hf import HFEngine
from rollstream.vision.processor import load_image_processor, load_processor


pytestmark = pytest.mark.timeout(180)

IMAGES = [noise_png(1), noise_png(2, 90, 30), noise_png(3, 20, 20)]


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir: Path) -> Any:
    return load_processor(tiny_vlm_dir)


@pytest.fixture(scope="module")
def ref_model(tiny_vlm_dir: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).eval()


def requests(processor: Any) -> list[tuple[list[int], list[bytes]]]:
    """Prompts with two images, one image, none, and the same image as another request."""
    shown = [[IMAGES[0], IMAGES[1]], [IMAGES[2]], [], [IMAGES[1]]]
    return [(vision_prompt(processor, imgs, f"What is {i}+1?"), imgs) for i, imgs in enumerate(shown)]


async def gen(engine: HFEngine, prompt: list[int], images: list[bytes], **kw: Any) -> ModelResponse:
    req = ModelRequest(input_ids=prompt, image_data=image_data(images) or None, gconfig=GenerationHyperparameters(**kw))
    return await engine.agenerate(req)


def assert_fresh(model: Any, image_processor: Any, resp: ModelResponse, images: list[bytes], start: int = 0) -> None:
    expected = fresh_logprobs(model, image_processor, resp, images)[start:]
    got = torch.tensor(resp.output_logprobs)[start:]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


async def test_images_rows_and_text_rows_share_decode_passes_and_match_a_fresh_pass(
    tiny_vlm_dir: Path, processor: Any, ref_model: Any,
) -> None:
    engine = HFEngine(str(tiny_vlm_dir), seed=0, max_batch_size=3)
    try:
        work = requests(processor)
        budgets = [9, 4, 12, 7]
        resps = await asyncio.gather(*(
            gen(engine, p, imgs, max_new_tokens=b, ignore_eos=True) for (p, imgs), b in zip(work, budgets)))
    finally:
        await engine.close()
    image_processor = load_image_processor(tiny_vlm_dir)
    for resp, (prompt, imgs), budget in zip(resps, work, budgets):
        assert resp.input_tokens == prompt and resp.output_len == budget
        assert_fresh(ref_model, image_processor, resp, imgs)  # rows joined and left a shared cache


async def test_a_weight_update_mid_generation_recomputes_rows_with_their_images(
    tiny_vlm_dir: Path, processor: Any, ref_model: Any, tmp_path: Path,
) -> None:
    from transformers import AutoModelForImageTextToText

    updated = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in updated.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    updated.save_pretrained(tmp_path / "v1")
    updated.eval()
    engine = HFEngine(str(tiny_vlm_dir), seed=1)
    await engine.start()
    try:
        work = requests(processor)[:2]
        tasks = [asyncio.create_task(gen(engine, p, imgs, max_new_tokens=30, ignore_eos=True)) for p, imgs in work]
        while engine.stats.tokens_generated < 2 * 5:
            await asyncio.sleep(0.002)
        await engine.pause()
        await engine.update_weights(WeightUpdate(version=1, path=str(tmp_path / "v1")))
        await engine.resume()
        resps = await asyncio.gather(*tasks)
    finally:
        await engine.close()
    image_processor = load_image_processor(tiny_vlm_dir)
    for resp, (_, imgs) in zip(resps, work):
        k = resp.output_versions.index(1)
        assert 0 < k < 30 and resp.output_versions == [0] * k + [1] * (30 - k)
        head = ModelResponse(resp.input_tokens, resp.output_tokens[:k], resp.output_logprobs[:k])
        assert_fresh(ref_model, image_processor, head, imgs)
        assert_fresh(updated, image_processor, resp, imgs, start=k)


async def test_requests_that_do_not_fit_their_images_fail_alone(tiny_vlm_dir: Path, processor: Any) -> None:
    engine = HFEngine(str(tiny_vlm_dir), seed=2)
    try:
        (two, imgs), (one, img) = requests(processor)[:2]
        results = await asyncio.gather(
            gen(engine, one, img, max_new_tokens=3),
            gen(engine, two, img, max_new_tokens=3),  # two images' slots, one image
            gen(engine, one, [], max_new_tokens=3),  # slots without images
            engine.agenerate(ModelRequest(input_ids=one, image_data=["not base64 !"])),
            gen(engine, one, img, max_new_tokens=3),
            return_exceptions=True,
        )
    finally:
        await engine.close()
    assert isinstance(results[0], ModelResponse) and isinstance(results[-1], ModelResponse)
    refused = results[1:-1]
    assert all(isinstance(r, InvalidRequestError) for r in refused), refused
    assert "image placeholder tokens but its 1 images make" in str(refused[0])
    assert "but its 0 images make 0 image tokens" in str(refused[1])
    assert "neither an existing file nor base64" in str(refused[2])


async def test_image_data_for_a_text_model_is_refused(tiny_model_dir: Path) -> None:
    engine = HFEngine(str(tiny_model_dir), seed=0)
    try:
        with pytest.raises(InvalidRequestError, match="text-only model"):
            await engine.agenerate(ModelRequest(input_ids=[5, 6], image_data=image_data(IMAGES[:1])))
    finally:
        await engine.close()

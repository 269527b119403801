"""The rollout worker with the tiny VLM against the real broker: each image's bytes go out once
per group, with the first episode that shows it, and an episode too large for
kafka.max_message_bytes is a failed sample naming its size and the limit, never a stuck worker."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import pytest

from harness.configs import make_config
from harness.images import noise_png
from harness.rollout_feed import TopicReader, publish_prompts, stop_worker
from rollstream.kafka.admin import ensure_topics
from rollstream.rollout_workers.service import run
from rollstream.vision.images import image_digest, open_image
from rollstream.wire import Episode, PromptTask, SampleRejected, decode_episode
from rollstream.workflows.vision_rlvr import VisionRLVRWorkflow
from rollstream.kafka.topics import TopicNames


pytestmark = pytest.mark.broker

LIMIT = 128 * 1024


class UpscalingVisionWorkflow(VisionRLVRWorkflow):
    """Shows the model its images at 3x the size (as a workflow that upsamples might): the
    episode then carries more image bytes than its prompt did."""

    def process(self, data: dict[str, Any]) -> Any:
        if data.get("upscale"):
            data = {**data, "images": [_upscaled(img) for img in data["images"]]}
        return super().process(data)


def _upscaled(data: bytes) -> bytes:
    img = open_image(data)
    out = io.BytesIO()
    img.resize((img.width * 3, img.height * 3)).save(out, format="PNG")
    return out.getvalue()


def _chat(images: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": "What is 2+2?"}]}]


async def test_images_go_out_once_per_group_and_an_oversized_episode_fails_alone(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_vlm_dir: Path,
) -> None:
    rollout = {
        "model_path": str(tiny_vlm_dir), "seed": 0, "worker_id": "w-vision", "commit_interval_seconds": 0.2,
        "max_concurrent_rollouts": 4, "gconfig": {"max_new_tokens": 4}, "default_workflow": "vision",
        "workflows": {"vision": {"path": f"{__name__}.UpscalingVisionWorkflow",
                                 "kwargs": {"gconfig": "$gconfig", "tokenizer": "$tokenizer", "processor": "$processor"}}},
    }
    config = make_config(kafka_bootstrap, redis_url, unique_name,
                         {"rollout": rollout, "kafka": {"max_message_bytes": LIMIT}})
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    cat, dog, big = noise_png(51), noise_png(52, 30, 40), noise_png(53, 90, 90)  # big: ~24 KB, ~177 KB upscaled
    prompts = [
        PromptTask(task_id="img-0", group_size=4, data={"messages": _chat(2), "images": [cat, dog], "answer": "4"}),
        PromptTask(task_id="img-1", group_size=2, data={"messages": _chat(1), "images": [big], "upscale": True}),
        PromptTask(task_id="img-2", group_size=2, data={"messages": _chat(1), "images": [dog]}),
    ]
    await publish_prompts(config, *prompts)
    stop = asyncio.Event()
    service = asyncio.create_task(run(config, stop))
    async with TopicReader(config, names.episodes, decode_episode) as reader:
        messages = await reader.until(lambda m: len(m) >= 8, timeout=120, what="8 sample messages")
    await stop_worker(service, stop)

    by_task: dict[str, list[Any]] = {}
    for message in messages:
        by_task.setdefault(message.task_id, []).append(message)
    group = by_task["img-0"]
    assert all(isinstance(m, Episode) for m in group) and len(group) == 4
    assert all(m.row_images == [[image_digest(cat), image_digest(dog)]] for m in group)
    assert all("images" not in m.data and m.data["answer"] == "4" for m in group)
    carried = [d for m in group for d in m.images]
    assert sorted(carried) == sorted([image_digest(cat), image_digest(dog)]), "each image once per group"
    assert group[0].images, "the first episode sent carries them"

    too_large = by_task["img-1"]
    assert len(too_large) == 2 and all(isinstance(m, SampleRejected) and m.failed for m in too_large)
    assert all(f"exceeds kafka.max_message_bytes={LIMIT}" in m.reason and "bytes of images" in m.reason
               for m in too_large)
    after = by_task["img-2"]
    assert len(after) == 2 and all(isinstance(m, Episode) for m in after)
    assert [d for m in after for d in m.images] == [image_digest(dog)]  # a new prompt sends its images again

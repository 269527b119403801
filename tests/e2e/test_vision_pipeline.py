"""Vision RL end to end: the tiers as processes on the real broker and Redis, the tiny VLM.

producer -> rollout worker (HFEngine, tiny Qwen2-VL built offline, VisionRLVRWorkflow) ->
reward worker -> grouping consumer -> StepStream with the VLM's image processor (this test
plays the trainer). 12 prompts x 4 samples with one or two images each; kafka.max_message_bytes
is 256 KiB, which holds each group's images once but not once per row (the two-image prompts
would need ~4 x 140 KB in a batch), and one more row's image is larger than the limit on its own.

Asserts: every admitted prompt ends as exactly one group or counted drop; the oversized row is a
dead letter naming its size and the limit, and the row after it goes through; each row of every
training batch comes with the vision inputs of its prompt's images, which reproduce the rollout's
logprobs within 1e-4 on a fresh forward pass; the image bytes on each topic equal the prompts'
distinct images once (reported, beside what per-sample copies would have cost).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from harness.batch_checks import acked_batches, check_vision_logprobs
from harness.configs import pipeline_config, write_config
from harness.images import noise_png
from harness.ledger import read_topic
from harness.tiers import TierProcess, running, stop_cleanly, tails
from rollstream.trainer import StepStream, TrainingStep
from rollstream.config import RollstreamConfig, config_from_dict
from rollstream.kafka.topics import TopicNames
from rollstream.wire import (
    EmittedGroup, Episode, GroupDropped, ScoredEpisode, decode_group, decode_dead_letter, decode_episode, decode_prompt, decode_scored,
)


pytestmark = [pytest.mark.broker, pytest.mark.slow]

PROMPTS = 12
GROUP_SIZE = 4
STEP_GROUPS = 4
LIMIT = 256 * 1024
OVERSIZED_ROW = 5  # its image alone is above LIMIT; the row after it must go through


def _images(i: int) -> list[bytes]:
    """One small image, or two large ones (~70 KB each: incompressible noise) every third prompt."""
    if i % 3 == 2:
        return [noise_png(100 + i, 150, 160), noise_png(200 + i, 160, 150)]
    return [noise_png(100 + i, 32 + i, 48)]


def _rows() -> list[dict[str, Any]]:
    rows = []
    for i in range(PROMPTS):
        images = _images(i)
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": f"What is {i % 5}+{i % 4}?"}]
        rows.append({"messages": [{"role": "user", "content": content}],
                     "images": [base64.b64encode(img).decode() for img in images], "answer": str(i % 5 + i % 4)})
    oversized = {**rows[0], "images": [base64.b64encode(noise_png(999, 300, 300)).decode()]}  # ~270 KB
    return rows[:OVERSIZED_ROW] + [oversized] + rows[OVERSIZED_ROW:]


def _write_inputs(tmp: Path, name: str, kafka: str, redis_url: str, model: Path) -> tuple[Path, RollstreamConfig]:
    dataset = tmp / "vision.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    tree = pipeline_config(
        kafka, redis_url, name, model, trial="vision",
        staleness={"groups_per_step": STEP_GROUPS, "max_head_offpolicyness": 3},
        kafka={"max_message_bytes": LIMIT},
        producer={"dataset": str(dataset), "group_size": GROUP_SIZE, "batch_linger_ms": 20},
        rollout={"max_concurrent_rollouts": 8, "gconfig": {"max_new_tokens": 8, "temperature": 1.0},
                 "workflows": {"vision": {"path": "vision_rlvr"}}, "default_workflow": "vision"},
        trainer={"processor_path": str(model)},
    )
    return write_config(tmp / "rollstream.yaml", tree), config_from_dict(tree)


async def _train_side(config: RollstreamConfig, tiers: dict[str, TierProcess]) -> list[TrainingStep]:
    async with StepStream(config, ledger=False) as consumer:
        return [batch async for batch in acked_batches(consumer, tiers, PROMPTS)]


async def test_vision_pipeline_end_to_end(
    tiny_vlm_dir: Path, kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path,
) -> None:
    config_path, config = _write_inputs(tmp_path, unique_name, kafka_bootstrap, redis_url, tiny_vlm_dir)
    names = TopicNames.of(config)
    with running(config_path, tmp_path, ("grouping", "reward-worker", "rollout-worker", "producer")) as tiers:
        batches = await _train_side(config, tiers)
        assert len(batches) * STEP_GROUPS == PROMPTS, f"only {len(batches)} steps\n{tails(tiers)}"
        stop_cleanly(tiers)

    prompts = await read_topic(config.kafka, names.prompts, decode_prompt)
    images_of = {p.task_id: p.data["images"] for p in prompts}
    assert sorted(p.index for p in prompts) == [i for i in range(PROMPTS + 1) if i != OVERSIZED_ROW]
    [letter] = await read_topic(config.kafka, names.dead_letter, decode_dead_letter)
    assert letter.tier == "producer" and letter.offset == OVERSIZED_ROW
    assert "too large for the prompts topic" in letter.reason and f"kafka.max_message_bytes={LIMIT}" in letter.reason
    outcomes = await read_topic(config.kafka, names.batches, decode_group)
    emitted = [m.task_id for m in outcomes if isinstance(m, EmittedGroup)]
    dropped = [m.task_id for m in outcomes if isinstance(m, GroupDropped)]
    assert sorted(emitted + dropped) == sorted(images_of), "every admitted prompt ends exactly once"
    assert sorted(tid for b in batches for tid in b.task_ids) == sorted(emitted)

    checked = check_vision_logprobs(batches, tiny_vlm_dir, images_of)
    episodes = [m for m in await read_topic(config.kafka, names.episodes, decode_episode) if isinstance(m, Episode)]
    scored = [m.episode for m in await read_topic(config.kafka, names.scored, decode_scored) if isinstance(m, ScoredEpisode)]
    assert all("images" not in e.data for e in episodes), "episodes do not copy the prompt's images"
    on_broker = {
        "prompts": sum(len(i) for p in prompts for i in p.data["images"]),
        "episodes": sum(len(i) for e in episodes for i in e.images.values()),
        "scored": sum(len(i) for e in scored for i in e.images.values()),
        "batches": sum(len(i) for b in outcomes if isinstance(b, EmittedGroup) for i in b.images),
    }
    once = sum(len(i) for images in images_of.values() for i in images)
    print(f"\ne2e vision: prompts={len(prompts)} groups={len(emitted)} dropped={len(dropped)} "
          f"logprobs checked={checked} (max |diff| <= 1e-4)")
    print(f"e2e vision: image bytes on the broker {on_broker}; each prompt's images once = {once}; "
          f"per-sample copies would be {GROUP_SIZE * once} per topic")
    assert on_broker == {"prompts": once, "episodes": once, "scored": once, "batches": once}

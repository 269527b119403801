"""The producer with image rows against the real broker: images travel as encoded files, and a
row too large for kafka.max_message_bytes (or with a broken image) is a dead letter naming why,
while the rows after it go through."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest

from harness.images import noise_png
from harness.producer_feed import producer_config, read_prompts
from rollstream.kafka.clients import make_consumer
from rollstream.producers.service import run_producer
from rollstream.wire import decode_dead_letter
from rollstream.kafka.topics import TopicNames


pytestmark = pytest.mark.broker

LIMIT = 64 * 1024


async def test_images_travel_as_files_and_an_oversized_row_is_a_dead_letter(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path,
) -> None:
    small, big = noise_png(1), noise_png(2, 200, 200)  # ~7 KB and ~120 KB of incompressible pixels
    (tmp_path / "small.png").write_bytes(small)
    rows = [
        {"messages": "q0", "images": base64.b64encode(small).decode()},
        {"messages": "q1", "images": [str(tmp_path / "small.png"), f"data:image/png;base64,{base64.b64encode(small).decode()}"]},
        {"messages": "q2", "images": [base64.b64encode(big).decode()]},  # too large for the limit
        {"messages": "q3", "images": ["not an image"]},
        {"messages": "q4", "answer": "4"},  # text rows are untouched
    ]
    dataset = tmp_path / "vision.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = producer_config(kafka_bootstrap, redis_url, unique_name, str(dataset))
    config.kafka.max_message_bytes = LIMIT
    summary = await asyncio.wait_for(run_producer(config, asyncio.Event()), 60)
    assert (summary.published, summary.dead_lettered) == (3, 2)
    prompts = {t.index: t for _, t in await read_prompts(config)}
    assert sorted(prompts) == [0, 1, 4]
    assert prompts[0].data["images"] == [small] and prompts[1].data["images"] == [small, small]
    assert prompts[4].data == {"messages": "q4", "answer": "4"}

    consumer = make_consumer(config.kafka, "test-dl", TopicNames.of(config).dead_letter, group_id=None)
    await consumer.start()
    try:
        records = await consumer.getmany(timeout_ms=5000)
    finally:
        await consumer.stop()
    letters = {d.offset: d for d in (decode_dead_letter(r.value) for rs in records.values() for r in rs)}
    assert sorted(letters) == [2, 3]
    too_large = letters[2].reason
    assert "row 2 is too large for the prompts topic" in too_large
    assert f"1 images of [{len(big)}] bytes" in too_large and f"exceeds kafka.max_message_bytes={LIMIT}" in too_large
    assert "row 3 cannot be encoded" in letters[3].reason and "neither an existing file nor base64" in letters[3].reason

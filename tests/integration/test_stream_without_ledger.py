"""``StepStream(config, ledger=False)`` against a real broker: only Kafka's committed offsets decide
what a restarted trainer gets again (a step not acked is redelivered, an acked one never)."""

from __future__ import annotations

import pytest

from harness.batches_feed import group, write_batches
from harness.configs import make_config
from rollstream.trainer import StepStream
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.topics import TopicNames
from rollstream.wire import GroupDropped


pytestmark = pytest.mark.broker


async def test_batches_are_redelivered_until_acked(kafka_bootstrap: str, redis_url: str, unique_name: str) -> None:
    config = make_config(
        kafka_bootstrap, redis_url, unique_name,
        # eta 4: these groups (tokens of version 1, tagged up to 4) are not stale when trained
        {"staleness": {"groups_per_step": 2, "max_head_offpolicyness": 4}, "trainer": {"group_id": f"{unique_name}-trainer"}}
    )
    await ensure_topics(config.kafka, TopicNames.of(config))
    await write_batches(config, [
        build_emitted_group(group("a"), trainer_version=2),
        GroupDropped(task_id="x", reason="timeout"),
        b"\x00 garbage",
        build_emitted_group(group("e", is_eval=True), trainer_version=2),
        build_emitted_group(group("b", gen_len=5), trainer_version=3),
        build_emitted_group(group("c"), trainer_version=3),
        build_emitted_group(group("d"), trainer_version=3),
        build_emitted_group(group("f"), trainer_version=4),
    ])
    async with StepStream(config, ledger=False) as consumer:
        first = await consumer.next_step(timeout=60)
        assert first is not None and first.task_ids == ["a", "b"]
        assert first.tensors["input_ids"].shape == (4, 8)  # 2 prompt + up to 6 generated tokens
        assert first.tensors["versions"][0].tolist() == [-1, -1, 1, 1, -1, -1, -1, -1]
        assert first.row_task == [0, 0, 1, 1] and first.trainer_versions == [2, 3]
        assert (first.head_version, first.tail_version, first.max_staleness) == (1, 1, 2)
        assert await consumer.ack(first)
        second = await consumer.next_step(timeout=60)
        assert second is not None and second.task_ids == ["c", "d"]  # read, never acked
        assert consumer.drops_by_reason == {"timeout": 1}
        assert (consumer.undecodable, consumer.eval_skipped) == (1, 1)
    async with StepStream(config, ledger=False) as again:
        redelivered = await again.next_step(timeout=60)
        assert redelivered is not None and redelivered.task_ids == ["c", "d"]
        assert await again.ack(redelivered)
        assert await again.next_step(timeout=2) is None  # "f" alone is not a full batch
    async with StepStream(config, ledger=False) as last:
        assert await last.next_step(timeout=2) is None  # c, d stay acked

"""The trainer's consumption bound against a real broker and Redis: a group that would reach a
step more than eta versions behind the version the step trains is dropped as stale, counted in
the step's ledger line and in the commit's metadata, and its staleness slot returns (also
through a budget rebuilt from the topics)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis

from harness.batches_feed import group, write_batches
from harness.configs import make_config
from harness.episodes import scored
from rollstream.api.engine import WeightUpdate
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.consumers.grouping.groups import CompleteGroup
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_admin
from rollstream.kafka.topics import TopicNames
from rollstream.kafka.trainer_commits import committed_stale_drops
from rollstream.producers.budget_restore import restore_budget
from rollstream.state.budget import RebuiltCounts, StalenessBudget
from rollstream.state.client import RedisKeys
from rollstream.state.version_store import VersionStore
from rollstream.trainer import StepStream, StepLedger
from rollstream.wire import decode_trainer_commit


pytestmark = pytest.mark.broker


def versioned(task: str, version: int) -> CompleteGroup:
    """A group of two samples whose generated tokens are all of ``version``."""
    eps = tuple(scored(task, i, 2, reward=float(i), gen_len=2 + i, version=version) for i in range(2))
    return CompleteGroup(task, 2, False, eps, 0, 0, 0, 0, 0.0)


async def test_a_stale_group_is_dropped_counted_and_its_slot_returned(
    kafka_bootstrap: str, redis_url: str, redis_client: aioredis.Redis, unique_name: str, tmp_path: Path,
) -> None:
    config = make_config(kafka_bootstrap, redis_url, unique_name, {
        "kafka": {"partitions": 1}, "staleness": {"groups_per_step": 2, "max_head_offpolicyness": 1},
        "trainer": {"group_id": f"{unique_name}-trainer", "ledger_path": str(tmp_path / "ledger.jsonl")}})
    names = TopicNames(unique_name, "t0")
    await ensure_topics(config.kafka, names)
    keys = RedisKeys(unique_name, "t0")
    budget = StalenessBudget(redis_client, keys, 1, 2)
    await budget.restore(RebuiltCounts([f"t{i}" for i in range(5)]))
    await VersionStore(redis_client, keys).publish(WeightUpdate(3, "/w/3"))  # the trainer is at 3
    # tokens of version 1 (group() writes version 1): 3 - 1 = 2 > eta 1 for the two trained at 3
    await write_batches(config, [build_emitted_group(group("t0"), trainer_version=3), build_emitted_group(group("t1"), 3)])
    async with StepStream(config) as stream:
        assert await stream.next_step(timeout=3) is None  # both stale: no step
        assert stream.drops_by_reason["stale"] == 2
    await write_batches(config, [build_emitted_group(versioned(f"t{i}", 2), 3) for i in (2, 3)])  # 3 - 2 <= 1
    async with StepStream(config) as stream:  # a restart: the drops were never committed
        step = await stream.next_step(timeout=30)
        assert step is not None and step.task_ids == ["t2", "t3"]
        await stream.commit(step)
    (entry,) = StepLedger(tmp_path / "ledger.jsonl").read()
    assert entry.task_ids == ["t2", "t3"] and entry.stale == ["t0", "t1"]
    admin = make_admin(config.kafka, "test-offsets")
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(config.trainer.group_id)
    finally:
        await admin.close()
    (meta,) = [decode_trainer_commit(m.metadata) for tp, m in offsets.items() if tp.topic == names.batches]
    assert meta is not None and (meta.step, meta.stale_dropped) == (1, 2)
    assert (await budget.read()).trainer_dropped == 2  # their slots are back
    # and a rebuild reads them from Kafka
    assert await committed_stale_drops(config.kafka, config.trainer.group_id, names.batches, "test-stale") == 2
    for key in await redis_client.keys(keys.key("*")):
        await redis_client.delete(key)  # Redis forgot everything
    await restore_budget(config, names, budget)
    assert (await budget.read()).trainer_dropped == 2

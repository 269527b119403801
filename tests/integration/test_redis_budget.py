"""The staleness budget against a real Redis: malformed keys, lost state, rebuild from topics."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from harness.configs import make_config
from rollstream.api.engine import WeightUpdate
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.producers.budget_restore import restore_budget, while_locked
from rollstream.state.budget import RebuildInterrupted, RebuiltCounts, StalenessBudget
from rollstream.state.client import GenerationChanged, RedisKeys, RedisStateError, StateMissingError
from rollstream.state.version_store import VersionStore
from rollstream.wire import GroupDropped, ProducerCursor, PromptTask, encode


pytestmark = pytest.mark.broker


def budget_of(client: aioredis.Redis, name: str, eta: int = 0, groups_per_step: int = 2) -> StalenessBudget:
    return StalenessBudget(client, RedisKeys(name, "t0"), eta, groups_per_step)


async def test_a_malformed_version_is_an_error_naming_the_key_never_a_crash(redis_client, unique_name: str) -> None:
    keys = RedisKeys(unique_name, "t0")
    budget = budget_of(redis_client, unique_name)
    await budget.restore(RebuiltCounts())
    await redis_client.set(keys.key("version"), "garbage")
    with pytest.raises(RedisStateError, match=r"version holds 'garbage', not an integer"):
        await VersionStore(redis_client, keys).get_version()
    with pytest.raises(RedisStateError, match="version"):
        await budget.try_admit("p:0:0")
    with pytest.raises(RedisStateError):
        await budget.usage()
    await VersionStore(redis_client, keys).publish(WeightUpdate(2, "/w/2"))  # the trainer repairs it
    assert await budget.try_admit("p:0:0") and (await budget.usage())["version"] == 2


async def test_without_its_state_the_budget_counts_nothing_until_restored(redis_client, unique_name: str) -> None:
    budget = budget_of(redis_client, unique_name, eta=0, groups_per_step=2)
    with pytest.raises(StateMissingError):
        await budget.try_admit("p:0:0")
    with pytest.raises(StateMissingError):
        await budget.release("p:0:0", "timeout")
    assert await budget.generation() is None
    assert await budget.restore(RebuiltCounts(["p:0:0"], admitted_count=1))
    generation = await budget.generation()
    assert generation is not None
    assert not await budget.restore(RebuiltCounts())  # a second rebuilder writes nothing
    assert await budget.generation() == generation
    assert await budget.try_admit("p:0:0", generation)  # known from the rebuild: not counted again
    assert await budget.try_admit("p:0:1", generation) and not await budget.try_admit("p:0:2", generation)  # capacity 2
    assert (await budget.usage())["admitted"] == 2
    assert await budget.release("p:0:1", "all_rejected")
    assert not await budget.release("p:0:1", "all_rejected")  # idempotent per task
    assert (await budget.usage())["dropped"] == 1


async def test_an_admission_in_a_generation_that_is_gone_is_refused(redis_client, unique_name: str) -> None:
    budget = budget_of(redis_client, unique_name, eta=0, groups_per_step=2)
    assert await budget.restore(RebuiltCounts())
    old = await budget.generation()
    assert await budget.try_admit("p:0:0", old)
    for key in await redis_client.keys(RedisKeys(unique_name, "t0").key("*")):
        await redis_client.delete(key)  # what a Redis restart without persistence does
    assert await budget.restore(RebuiltCounts())
    with pytest.raises(GenerationChanged) as refused:
        await budget.try_admit("p:0:1", old)
    assert refused.value.current == await budget.generation() != old
    assert (await budget.usage())["admitted"] == 0  # nothing counted by the refused admission


async def test_restore_rebuilds_the_counters_from_the_topics(
    kafka_bootstrap: str, redis_url: str, redis_client, unique_name: str
) -> None:
    config = make_config(kafka_bootstrap, redis_url, unique_name)
    names = TopicNames(unique_name, "t0")
    await ensure_topics(config.kafka, names)
    producer = make_producer(config.kafka, "feeder")
    await producer.start()
    try:
        for i in range(6):
            task = PromptTask(task_id=f"p:0:{i}", group_size=2, data={}, is_eval=i >= 4)
            await producer.send_and_wait(names.prompts, encode(task), key=task.task_id.encode())
        for task_id, reason in (("p:0:1", "timeout"), ("p:0:4", "all_rejected")):  # p:0:4 is eval
            drop = GroupDropped(task_id=task_id, reason=reason, is_eval=task_id == "p:0:4")
            await producer.send_and_wait(names.batches, encode(drop), key=task_id.encode())
        # retention deleted a producer's early prompts: its cursor still counts all 7
        cursor = ProducerCursor(producer_id="other", epoch=0, index=0, published=7)
        await producer.send_and_wait(names.producer_cursor, encode(cursor), key=b"other")
    finally:
        await producer.stop()
    budget = budget_of(redis_client, unique_name, eta=2, groups_per_step=2)
    await restore_budget(config, names, budget)
    assert (await budget.usage())["admitted"] == 7 and (await budget.usage())["dropped"] == 1
    assert await budget.drops_by_reason() == {"timeout": 1}
    assert await budget.try_admit("p:0:3") and (await budget.usage())["admitted"] == 7  # a marker
    await restore_budget(config, names, budget)  # has its state: a no-op
    assert (await budget.usage())["admitted"] == 7


async def test_the_rebuild_lock_lives_as_long_as_the_rebuild_and_a_lost_lock_stops_it(
    redis_client, unique_name: str
) -> None:
    budget = budget_of(redis_client, unique_name)
    assert await budget.lock("r1", 0.6) is not None and await budget.lock("r2", 0.6) is None
    await while_locked(budget, "r1", asyncio.sleep(2.0), ttl_seconds=0.6)  # past three TTLs: renewed
    assert await budget.lock("r2", 0.6) is None  # still r1's
    stolen = asyncio.Event()

    async def long_rebuild() -> None:
        await redis_client.delete(RedisKeys(unique_name, "t0").key("restore-lock"))  # expired, say
        await budget.lock("r2", 60)
        stolen.set()
        await asyncio.sleep(30)

    with pytest.raises(RebuildInterrupted):
        await asyncio.wait_for(while_locked(budget, "r1", long_rebuild(), ttl_seconds=0.6), 10)
    assert stolen.is_set()
    with pytest.raises(RebuildInterrupted):  # and its final write is refused on a lock it does not hold
        await budget.restore(RebuiltCounts(), lock_holder="r1")

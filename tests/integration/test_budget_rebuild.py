"""The staleness bound through a Redis that forgets, with the bad interleavings forced.

A rebuild of the budget's counters (``restore_budget``) races with producers that admitted
prompts before the loss and have not committed them. Each test below stops a producer at one
point of its admit -> transaction -> commit path, makes Redis lose the trial's state there,
rebuilds, lets the producer go on, and checks the invariant the bound rests on: no prompt is
committed that the counters in force do not count (committed train prompts <= admitted), and
the counters are exact once everything is committed (docs/GUARANTEES.md, section 13).

"Redis loses the state" is the deletion of the trial's keys (what a restart without
persistence does to them), so the session's Redis stays shared with other tests.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis

from harness.producer_feed import STEP_GROUPS, Producer, committed_train_prompts, producer_config, write_dataset
from rollstream.config import RollstreamConfig
from rollstream.kafka.transactions import TransactionalProducer, TransactionFenced
from rollstream.producers.admission import Admission, BudgetRebuilt
from rollstream.producers.budget_restore import restore_budget
from rollstream.producers.cursor import advance
from rollstream.producers.publisher import PendingBatch, PromptPublisher
from rollstream.producers.service import run_producer
from rollstream.retry import RetryPolicy
from rollstream.state.client import RedisKeys
from rollstream.wire import ProducerCursor, PromptTask, encode


pytestmark = pytest.mark.broker

async def lose_state(redis: aioredis.Redis, config: RollstreamConfig) -> None:
    keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
    doomed = await redis.keys(keys.key("*"))
    if doomed:
        await redis.delete(*doomed)


@pytest.fixture
def configs(kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path) -> dict[str, RollstreamConfig]:
    dataset = write_dataset(tmp_path / "d.jsonl", 6)
    staleness = {"groups_per_step": STEP_GROUPS, "max_head_offpolicyness": 0}
    return {
        pid: producer_config(kafka_bootstrap, redis_url, unique_name, dataset, producer_id=pid, staleness=dict(staleness))
        for pid in ("a", "b")
    }


@pytest.fixture
def redis(redis_client: aioredis.Redis) -> aioredis.Redis:
    return redis_client


async def test_a_batch_admitted_before_the_loss_is_never_committed(configs, redis) -> None:  # type: ignore[no-untyped-def]
    a = Producer(configs["a"], redis)
    await a.start()
    pending = await a.admit(3)  # counted in the old generation, not committed
    await lose_state(redis, a.config)
    await restore_budget(a.config, a.names, a.budget)  # another producer found the state missing
    assert (await a.budget.usage())["admitted"] == 0  # nothing is committed: the rebuild counts nothing
    with pytest.raises(BudgetRebuilt):
        await a.publisher.commit(pending)  # the rebuild fenced it: this can never commit
    assert await committed_train_prompts(a.config) == 0
    await a.txn.stop()
    # the producer starts again from its committed cursor and admits the same prompts anew
    again = msgspec.structs.replace(a.config, producer=msgspec.structs.replace(a.config.producer, max_prompts=STEP_GROUPS))
    summary = await asyncio.wait_for(run_producer(again, asyncio.Event()), 60)
    assert summary.published == STEP_GROUPS  # the bound (4 at version 0), every one counted
    assert await committed_train_prompts(a.config) == (await a.budget.usage())["admitted"] == STEP_GROUPS


async def test_a_transaction_open_at_the_loss_is_aborted_by_the_rebuild(configs, redis) -> None:  # type: ignore[no-untyped-def]
    a = Producer(configs["a"], redis)
    await a.start()
    pending = await a.admit(2)
    sent, go_on = asyncio.Event(), asyncio.Event()

    async def write(producer):  # type: ignore[no-untyped-def]
        futures = [await producer.send(a.names.prompts, value, key=key) for key, value in pending.prompts]
        sent.set()
        await go_on.wait()  # the records are on the broker, the transaction is open
        return futures

    commit = asyncio.create_task(a.txn.commit(write))
    await sent.wait()
    await lose_state(redis, a.config)
    await restore_budget(a.config, a.names, a.budget)  # fences a: its open transaction is aborted
    go_on.set()
    with pytest.raises(TransactionFenced):
        await commit
    assert await a.admission.rebuilt()  # so the publisher answers BudgetRebuilt, not "duplicate id"
    assert await committed_train_prompts(a.config) == 0 == (await a.budget.usage())["admitted"]


async def test_a_producer_restarted_after_the_fence_checks_the_generation_before_it_sends(configs, redis) -> None:  # type: ignore[no-untyped-def]
    a = Producer(configs["a"], redis)
    await a.start()
    pending = await a.admit(2)
    await lose_state(redis, a.config)
    await restore_budget(a.config, a.names, a.budget)
    await a.txn.stop()
    await a.txn.start()  # a retry on a new producer after the fence: not fenced itself
    with pytest.raises(BudgetRebuilt):
        await a.publisher.commit(pending)  # the generation check inside the transaction stops it
    assert await committed_train_prompts(a.config) == 0


async def test_an_admission_after_the_rebuild_is_refused_to_a_producer_of_the_old_generation(configs, redis) -> None:  # type: ignore[no-untyped-def]
    a, b = Producer(configs["a"], redis), Producer(configs["b"], redis)
    await a.start()
    await b.start()
    await a.admit(2)  # pending in a: 2 of the 4 slots
    await lose_state(redis, a.config)
    b_batch = PendingBatch()
    for index in range(STEP_GROUPS):  # b finds the state missing, rebuilds, and takes the whole bound
        task = PromptTask(task_id=f"b:0:{index}", group_size=2, data={})
        try:
            assert await b.admission.try_admit(task.task_id, is_eval=False)
        except BudgetRebuilt:  # b's own uncommitted start is also of the old generation
            await b.txn.stop()
            await b.admission.begin()
            await b.txn.start()
            assert await b.admission.try_admit(task.task_id, is_eval=False)
        b_batch.add_prompt(task, encode(task), advance(b.cursor, 0, index + 1, index + 1))
    await b.publisher.commit(b_batch)
    with pytest.raises(BudgetRebuilt):
        await a.admission.try_admit("a:0:2", is_eval=False)  # a must start over, not add a third
    committed = await committed_train_prompts(a.config)
    assert committed == STEP_GROUPS == (await a.budget.usage())["admitted"]  # never beyond the bound


async def test_the_rebuild_sees_prompts_committed_above_an_open_transaction_and_fences_eval_producers(
    configs, redis  # type: ignore[no-untyped-def]
) -> None:
    """A transaction left open on ``prompts`` by a writer no fence knows holds the last stable
    offset back; train prompts committed above it must still be counted (the rebuild reads to
    the high watermark after its fence, waiting for that transaction). An eval producer is
    fenced too: its open transaction is aborted and its commit answers BudgetRebuilt."""
    one = {pid: msgspec.structs.replace(c, kafka=msgspec.structs.replace(c.kafka, partitions=1))
           for pid, c in configs.items()}  # every record in one partition, behind the open transaction
    eval_config = msgspec.structs.replace(one["b"], producer=msgspec.structs.replace(one["b"].producer, is_eval=True))
    a, e = Producer(one["a"], redis), Producer(eval_config, redis)
    e.admission = Admission(e.budget, redis, 0.2, e.stop, counts=False,
                            restore=lambda: restore_budget(e.config, e.names, e.budget))
    e.publisher = PromptPublisher(e.txn, e.names, RetryPolicy(initial=0.1, max_attempts=3), e.admission)
    e.cursor = ProducerCursor(producer_id="b", epoch=0, index=0, published=0, is_eval=True)
    await a.start()
    await e.start()
    other = TransactionalProducer(a.config.kafka, "test-other", f"{a.names.prompts}.other-writer")
    await other.start()
    held_open, release = asyncio.Event(), asyncio.Event()

    async def write_and_hold(producer):  # type: ignore[no-untyped-def]
        task = PromptTask(task_id="other:0:0", group_size=2, data={}, is_eval=True)
        futures = [await producer.send(a.names.prompts, encode(task), key=b"other:0:0")]
        await asyncio.gather(*futures)
        held_open.set()
        await release.wait()
        return []

    holding = asyncio.create_task(other.commit(write_and_hold))
    eval_sent = asyncio.Event()

    async def eval_write(producer):  # type: ignore[no-untyped-def]
        task = PromptTask(task_id="b:0:0", group_size=2, data={}, is_eval=True)
        futures = [await producer.send(a.names.prompts, encode(task), key=b"b:0:0")]
        await asyncio.gather(*futures)
        eval_sent.set()
        await release.wait()
        return futures

    eval_open = asyncio.create_task(e.txn.commit(eval_write))
    await held_open.wait()
    await eval_sent.wait()
    await a.publisher.commit(await a.admit(2))  # committed above both open transactions
    await lose_state(redis, a.config)
    rebuilding = asyncio.create_task(restore_budget(a.config, a.names, a.budget))
    await asyncio.sleep(2.0)
    assert not rebuilding.done()  # waiting for the open transaction, not reading past it
    release.set()
    await asyncio.wait_for(rebuilding, 60)
    await holding
    assert (await a.budget.usage())["admitted"] == 2  # the two prompts above the open transaction
    generation = (await a.budget.generation()).encode()  # type: ignore[union-attr]
    keys = RedisKeys(a.config.experiment.experiment_name, a.config.experiment.trial_name)
    for index in (0, 1):  # read from the topic itself (not only from the cursor's count): their markers
        assert await redis.get(keys.key(f"admit:a:0:{index}")) == generation
    with pytest.raises(TransactionFenced):
        await eval_open  # the eval producer was fenced: its open transaction was aborted
    assert await e.admission.rebuilt()  # so its publisher answers BudgetRebuilt, not "duplicate id"
    await other.stop()

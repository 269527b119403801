"""Redis comes back with the state of an earlier moment: every guarantee holds, forced in order.

Each test runs its own redis-server with the persistence the project deploys (AOF, fsync every
second), takes a snapshot (an RDB file, what a restart from the last snapshot or a lagging
replica holds), does more work, then crashes Redis and starts it from that snapshot
(``LocalRedisServer.restore``): a new redis-server process with old keys. What must hold:

- the staleness budget: the stale counters count nothing; the budget is rebuilt from the
  topics, exactly, and no prompt is admitted beyond the bound; an idempotency marker of the
  earlier moment does not hide an admission from the new counters;
- the versions: readers never go back (the grouping tier's floor comes from its changelog), the
  capacity uses the version the topics prove, and the trainer publishes on;
- the weight-sync leases: no lease granted on the old process is trusted on the new one, and
  no new owner is granted one until every grant of the old process has run out locally;
- the prompt claims: a prompt running on a live worker is not run again though its claim is gone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis

from rollstream.config import RollstreamConfig
from rollstream.dev.redis_server import LocalRedisServer
from rollstream.producers.admission import BudgetRebuilt
from rollstream.producers.cursor import advance
from rollstream.producers.publisher import PendingBatch
from rollstream.state.client import StateStaleError, wait_for_redis
from rollstream.wire import PromptTask, encode
from tests.integration.test_budget_rebuild import BATCH, Producer, committed_train_prompts
from tests.integration.test_producer_service import producer_config, write_dataset

pytestmark = pytest.mark.broker


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[LocalRedisServer]:
    with LocalRedisServer(tmp_path / "redis", appendonly=True) as server:
        yield server


@pytest.fixture
async def client(redis_server: LocalRedisServer) -> aioredis.Redis:
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def restore(server: LocalRedisServer, snapshot: Path, client: aioredis.Redis) -> None:
    """Start ``server`` again from ``snapshot``; ``client``'s next call finds it (its pooled
    connection to the crashed process answers one ConnectionError, as any client's does)."""
    server.restore(snapshot)
    await wait_for_redis(client)


def config_for(kafka_bootstrap: str, redis_server: LocalRedisServer, unique_name: str, tmp_path: Path,
               producer_id: str = "a") -> RollstreamConfig:
    dataset = write_dataset(tmp_path / "d.jsonl", 6)
    staleness = {"batch_size": BATCH, "max_head_offpolicyness": 0}  # capacity 4 at version 0
    return producer_config(kafka_bootstrap, redis_server.url, unique_name, dataset, producer_id=producer_id,
                           staleness=staleness)


async def admit(producer: Producer, first: int, n: int) -> PendingBatch:
    """Admit train prompts ``first .. first + n - 1`` of ``producer`` into a pending batch."""
    batch = PendingBatch()
    pid = producer.config.producer.producer_id
    for index in range(first, first + n):
        task = PromptTask(task_id=f"{pid}:0:{index}", group_size=2, data={"q": index})
        assert await producer.admission.try_admit(task.task_id, is_eval=False)
        batch.add_prompt(task, encode(task), advance(producer.cursor, 0, index + 1, index + 1))
    return batch


async def test_a_budget_restored_from_a_snapshot_is_rebuilt_and_never_admits_beyond_the_bound(
    kafka_bootstrap: str, redis_server: LocalRedisServer, client: aioredis.Redis, unique_name: str, tmp_path: Path,
) -> None:
    a = Producer(config_for(kafka_bootstrap, redis_server, unique_name, tmp_path), client)
    await a.start()  # the first rebuild (empty topics): generation g1 on this redis-server
    await a.publisher.commit(await admit(a, 0, 2))  # 2 of the 4 slots committed
    uncommitted = await admit(a, 2, 1)  # p:0:2 admitted in g1, not committed: its marker is in the snapshot
    snapshot = redis_server.snapshot()  # Redis holds: admitted 3
    await a.publisher.commit(uncommitted)
    await a.publisher.commit(await admit(a, 3, 1))  # committed: 4 = the bound
    assert not await a.budget.try_admit("a:0:4", await a.budget.generation())  # full
    await restore(redis_server, snapshot, client)  # a new process with the snapshot's keys: admitted 3 (truth: 4)

    before = await a.budget.read()
    assert (before.admitted, before.state) == (3, "stale")
    with pytest.raises(StateStaleError):
        await a.budget.try_admit("a:0:4")  # the stale counters would admit it: they count nothing
    assert await a.budget.generation() is None
    with pytest.raises(BudgetRebuilt):  # the producer meets the stale state, rebuilds, is fenced
        await a.admission.try_admit("a:0:4", is_eval=False)
    after = await a.budget.read()
    assert (after.admitted, after.state) == (4, "valid") == (await committed_train_prompts(a.config), "valid")
    # the producer starts again from its cursor (index 4): the bound holds, nothing is counted twice
    await a.txn.stop()
    await a.admission.begin()
    await a.txn.start()
    assert not await a.admission.try_admit("a:0:4", is_eval=False)
    # a marker of the earlier moment (p:0:2 in g1) never stands for an admission in the new state
    marker = await client.get(a.budget._keys.key("admit:a:0:2"))
    assert marker == (await a.budget.generation()).encode()  # rewritten by the rebuild: committed


async def test_a_snapshot_from_before_a_rebuild_is_stale_too_and_its_markers_count_for_nothing(
    kafka_bootstrap: str, redis_server: LocalRedisServer, client: aioredis.Redis, unique_name: str, tmp_path: Path,
) -> None:
    a = Producer(config_for(kafka_bootstrap, redis_server, unique_name, tmp_path), client)
    await a.start()
    await admit(a, 0, 2)  # admitted in g1, never committed (the producer crashes)
    snapshot = redis_server.snapshot()  # g1: admitted 2, markers of a:0:0 and a:0:1
    await restore(redis_server, snapshot, client)  # a restart: the same keys, another process -> rebuilt (g2: 0)
    await a.txn.stop()
    with pytest.raises(BudgetRebuilt):
        await a.admission.try_admit("a:0:2", is_eval=False)
    assert (await a.budget.read()).admitted == 0
    await a.admission.begin()
    await a.txn.start()
    await restore(redis_server, snapshot, client)  # and back to g1's state: older than the rebuild
    with pytest.raises(BudgetRebuilt):  # stale again: rebuilt again, never trusted
        await a.admission.try_admit("a:0:0", is_eval=False)
    await a.txn.stop()
    await a.admission.begin()
    await a.txn.start()
    # g1's markers said a:0:0 and a:0:1 were admitted; the new state counts them anew
    for index in range(BATCH):
        assert await a.admission.try_admit(f"a:0:{index}", is_eval=False)
    assert not await a.admission.try_admit(f"a:0:{BATCH}", is_eval=False)
    assert (await a.budget.read()).admitted == BATCH

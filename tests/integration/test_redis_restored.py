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
import asyncio

import pytest
import redis.asyncio as aioredis
from aiokafka.structs import ConsumerRecord, TopicPartition

from harness.configs import make_config
from harness.episodes import scored
from harness.fake_sglang import FakeSGLangServer
from harness.producer_feed import STEP_GROUPS, Producer, budget_of, committed_train_prompts, producer_config, write_dataset
from harness.waits import until, within
from rollstream.api.engine import WeightUpdate
from rollstream.config import RollstreamConfig, ServerConfig
from rollstream.consumers.grouping.transform import GroupingTransform
from rollstream.dev.redis_server import LocalRedisServer
from rollstream.engines.server_http import ServerHttp
from rollstream.engines.sglang_admin import SGLangAdmin
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_producer
from rollstream.kafka.consume_transform_produce import PartitionOutput
from rollstream.kafka.topics import TopicNames
from rollstream.producers.admission import BudgetRebuilt
from rollstream.producers.budget_restore import restore_budget
from rollstream.producers.cursor import advance
from rollstream.producers.publisher import PendingBatch
from rollstream.rollout_workers.claims import Outcome, PromptClaims
from rollstream.rollout_workers.weight_sync import SyncCandidate
from rollstream.state.client import RedisKeys, StateStaleError, wait_for_redis
from rollstream.state.server_lease import ServerLeases, ServerSyncState
from rollstream.state.version_store import VersionStore
from rollstream.trainer.version_publisher import VersionPublisher
from rollstream.wire import EmittedGroup, PromptTask, decode_group, decode_outcome, encode


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
    staleness = {"groups_per_step": STEP_GROUPS, "max_head_offpolicyness": 0}  # capacity 4 at version 0
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
    for index in range(STEP_GROUPS):
        assert await a.admission.try_admit(f"a:0:{index}", is_eval=False)
    assert not await a.admission.try_admit(f"a:0:{STEP_GROUPS}", is_eval=False)
    assert (await a.budget.read()).admitted == STEP_GROUPS


async def emit_one(transform: GroupingTransform, names: TopicNames, config: RollstreamConfig, task_id: str,
                   token_version: int, offset: int) -> PartitionOutput:
    """One grouping cycle on partition 0: a complete group of 2 samples whose tokens are all of
    ``token_version``; the cycle's output (a batch and its changelog outcome)."""
    records = []
    for idx in range(2):
        value = encode(scored(task_id, idx, group_size=2, version=token_version))
        records.append(ConsumerRecord(names.scored, 0, offset + idx, 0, 0, task_id.encode(), value, None,
                                      len(task_id), len(value), ()))
    out = PartitionOutput(0, config.kafka.max_message_bytes)
    await transform.begin({0: records})
    for record in records:
        await transform.transform(record, out)
    await transform.finish(0, out, final=True)
    return out


def the_batch(out: PartitionOutput, names: TopicNames) -> EmittedGroup:
    (batch,) = [decode_group(r.value) for r in out.records if r.topic == names.batches]
    assert isinstance(batch, EmittedGroup)
    return batch


async def test_versions_never_go_back_for_their_readers_when_redis_comes_back_older(
    kafka_bootstrap: str, redis_server: LocalRedisServer, client: aioredis.Redis, unique_name: str,
) -> None:
    config = make_config(kafka_bootstrap, redis_server.url, unique_name,
                         {"staleness": {"groups_per_step": 2, "max_head_offpolicyness": 1}})
    names = TopicNames(unique_name, "t0")
    await ensure_topics(config.kafka, names)
    store = VersionStore(client, RedisKeys(unique_name, "t0"))
    await store.publish(WeightUpdate(2, "/w/2"))
    snapshot = redis_server.snapshot()  # version 2
    for version in range(3, 8):  # the trainer goes on to 7
        await store.publish(WeightUpdate(version, f"/w/{version}"))
    first = GroupingTransform(config, names, client)
    out = await emit_one(first, names, config, "t:0:0", token_version=6, offset=0)
    assert the_batch(out, names).trainer_version == 7
    outcome = next(decode_outcome(r.value) for r in out.records if r.topic == names.grouping_changelog)
    assert outcome.trainer_version == 7  # the changelog remembers the tag
    producer = make_producer(config.kafka, "committer")  # what the cycle's transaction commits
    await producer.start()
    try:
        for record in out.records:
            await producer.send_and_wait(record.topic, record.value, key=record.key, partition=record.partition)
    finally:
        await producer.stop()

    await restore(redis_server, snapshot, client)  # Redis says version 2; the truth is 7
    assert await store.get_version() == 2
    # a new grouping instance takes partition 0: its floor is the changelog's, not Redis's
    second = GroupingTransform(config, names, client)
    await second.acquire({0})
    batch = the_batch(await emit_one(second, names, config, "t:0:1", token_version=2, offset=2), names)
    assert (batch.trainer_version, batch.trainer_version_known) == (7, False)  # never below 7 on partition 0
    # the budget's capacity uses the version the topics prove (7), not Redis's 2
    budget = budget_of(config, client)
    await restore_budget(config, names, budget)
    usage = await budget.read()
    assert (usage.version, usage.version_floor, usage.capacity) == (2, 7, (1 + 7 + 1) * 2)
    # the trainer publishes on from its own count: readers follow it upwards again
    async with VersionPublisher(config) as publisher:
        await publisher.publish(8, "s3://weights/8")
    assert await store.get_version() == 8


async def test_a_lease_redis_forgot_is_void_for_its_holder_and_the_server_is_granted_anew(
    redis_server: LocalRedisServer, client: aioredis.Redis, unique_name: str,
) -> None:
    url = "http://gpu0:30000"
    a, b, c = (ServerLeases(client, RedisKeys(unique_name, "t0"), owner, 5.0) for owner in "abc")
    first = await a.acquire(url)
    assert first is not None
    snapshot = redis_server.snapshot()  # a holds the server
    await a.release(first)
    second = await b.acquire(url)  # then b, on this redis-server process
    assert second is not None and second.token > first.token
    await restore(redis_server, snapshot, client)  # Redis says a holds it: granted on a process that is gone
    assert await c.holder(url) is None  # no lease at all
    first.lost = False
    state = ServerSyncState(url=url, owner="a", token=first.token, phase="pausing")
    assert not await a.renew(first) and not await a.write_state(first, state)  # a cannot come back with it
    second_state = ServerSyncState(url=url, owner="b", token=second.token, phase="pausing")
    assert not await b.write_state(second, second_state)  # b's grant was forgotten: b's next step is refused
    third = await c.acquire(url)
    assert third is not None and third.token > second.token  # tokens grow across the restore
    assert not await b.renew(second) and await c.holder(url) == ("c", third.token)


async def test_an_owner_takes_no_step_on_a_lease_redis_cannot_confirm(
    redis_server: LocalRedisServer, client: aioredis.Redis, unique_name: str,
) -> None:
    """An owner told of a new version while Redis is down pauses nothing (it could not know its
    grant survives); Redis comes back from a snapshot that forgot the grant: the owner finds its
    lease void, takes the server again (a new grant) and loads the version exactly once."""
    settings = ServerConfig(lease_ttl_seconds=2.0, reconcile_seconds=0.3, pause_timeout_seconds=2.0,
                            health_probe_timeout_seconds=2.0)
    http = ServerHttp(settings)
    async with FakeSGLangServer(token_delay=0.005) as server:
        leases = ServerLeases(aioredis.from_url(redis_server.url), RedisKeys(unique_name, "t0"), "w0", 2.0)
        owner = SyncCandidate(server.url, SGLangAdmin(http), leases, settings)
        task = asyncio.create_task(owner.run())
        try:
            await until(lambda: owner.lease is not None and server.hits["continue"] >= 1, "the owner's lease")
            snapshot = redis_server.snapshot()
            redis_server.kill()
            owner.offer(WeightUpdate(1, "/ckpt/v1"))
            await asyncio.sleep(1.0)  # within its lease's local deadline, Redis unreachable
            assert server.hits["pause"] == 0 and not server.loads
            await restore(redis_server, snapshot, client)
            await until(lambda: server.version == 1 and not server.paused, "the server on v1", 20)
            assert len(server.loads) == 1 and server.hits["pause"] == 1
        finally:
            task.cancel()
            await within(asyncio.gather(task, return_exceptions=True), 10, "stopping the owner")
            await within(http.close(), 5, "closing the client")


async def test_a_prompt_running_on_a_live_worker_is_not_run_again_though_its_claim_is_gone(
    redis_server: LocalRedisServer, client: aioredis.Redis, unique_name: str,
) -> None:
    """A snapshot from before worker a claimed one prompt and finished another: after the
    restore Redis knows neither. Worker b is told UNSURE (never RUN) until a, alive, wrote both
    again (its next heartbeat finds Redis changed process); then HELD and DONE."""
    window = 2.0  # rollout.failure_detection_seconds
    keys = RedisKeys(unique_name, "t0")
    a, b = PromptClaims(client, keys, "a", window), PromptClaims(client, keys, "b", window)
    await asyncio.sleep(window)  # a new redis-server settles for one window before it vouches for absences
    await a.register()
    await b.register()
    snapshot = redis_server.snapshot()
    tp = TopicPartition("prompts", 0)
    running, finished = ("1:p:0:0", 0), ("1:p:0:1", 1)
    for identity, offset in (running, finished):
        assert (await a.claim(0, offset, identity)).outcome is Outcome.RUN
        a.local.started(tp, offset, identity)
    a.local.finished(tp, finished[1], finished[0])
    a.done(0, finished[1], finished[0])
    await a._flush()
    assert (await b.claim(0, running[1], running[0])).outcome is Outcome.HELD
    await restore(redis_server, snapshot, client)  # Redis forgot both claims
    assert (await b.claim(0, running[1], running[0])).outcome is Outcome.UNSURE  # not RUN: a may live
    upkeep = asyncio.create_task(a.maintain())  # a's next heartbeat sees the new process and writes again
    try:
        await asyncio.sleep(window + 0.5)
        held = await b.claim(0, running[1], running[0])
        assert (held.outcome, held.holder) == (Outcome.HELD, "a")
        assert (await b.claim(0, finished[1], finished[0])).outcome is Outcome.DONE
    finally:
        upkeep.cancel()
        await asyncio.gather(upkeep, return_exceptions=True)

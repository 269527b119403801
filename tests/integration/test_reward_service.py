"""The reward worker against the real broker and Redis: transactional, exactly-once scoring."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from aiokafka import TopicPartition

from harness.configs import make_config
from harness.fakes import ids, make_tokenizer
from harness.ledger import read_topic as read_committed
from harness.tiers import TierProcess
from rollstream.config import RollstreamConfig
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_admin, make_consumer, make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.reward_workers.service import run
from rollstream.wire import (
    Episode,
    SampleRejected,
    ScoredEpisode,
    TaskFailed,
    decode_dead_letter,
    decode_scored,
    encode,
)
from rollstream.wire.torch_tensors import decode_tensor_dict, encode_tensor_dict


pytestmark = [pytest.mark.broker, pytest.mark.timeout(180)]


def trajectory(i: int) -> dict[str, torch.Tensor]:
    """A distinct one-row trajectory per ``i`` whose completion text contains "five"."""
    prompt = ids("what is two plus three" + " please" * (i % 4))
    completion = ids("the answer is five") + [2]  # 2 = <eos>
    tokens = prompt + completion
    return {
        "input_ids": torch.tensor([tokens], dtype=torch.int32),
        "attention_mask": torch.ones(1, len(tokens), dtype=torch.bool),
        "loss_mask": torch.tensor([[0] * len(prompt) + [1] * len(completion)], dtype=torch.int32),
        "logprobs": torch.tensor([[0.0] * len(prompt) + [-0.3] * len(completion)], dtype=torch.float32),
        "versions": torch.tensor([[-1] * len(prompt) + [0] * len(completion)], dtype=torch.int32),
    }


def episode(i: int) -> Episode:
    answer = "five" if i % 3 else "seven"  # so every third episode scores 0.0
    return Episode(
        task_id=f"p:0:{i}", sample_idx=0, group_size=1, trajectory=encode_tensor_dict(trajectory(i)),
        data={"answer": answer},
    )


def expected_reward(i: int) -> float:
    return 1.0 if i % 3 else 0.0



def reward_config(kafka: str, redis: str, name: str, tokenizer: str, **reward: Any) -> RollstreamConfig:
    sections = {"reward": {"tokenizer_path": tokenizer, "max_batch": 8, "worker_id": "w-1",
                           "session_timeout_ms": 6000, "max_workers": 1, **reward}}
    return make_config(kafka, redis, name, sections)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(path)
    return str(path)


async def produce_episodes(config: RollstreamConfig, values: list[tuple[bytes, bytes]]) -> None:
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    producer = make_producer(config.kafka, "test-episodes")
    await producer.start()
    try:
        for key, value in values:
            await producer.send_and_wait(names.episodes, value, key=key)
    finally:
        await producer.stop()


async def read_topic(config: RollstreamConfig, topic: str, decode: Callable[[bytes], Any]) -> list[Any]:
    """Every committed message of ``topic``, decoded (settled: the worker's last commit markers
    may land after its commit returned)."""
    return await read_committed(config.kafka, topic, decode, settled=True)


async def wait_for_scored(config: RollstreamConfig, n: int, timeout: float = 90.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        scored = await read_topic(config, TopicNames.of(config).scored, decode_scored)
        if len(scored) >= n:
            return scored
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(scored)} of {n} scored messages after {timeout}s")
        await asyncio.sleep(0.2)


async def test_scores_every_episode_once_and_dead_letters_garbage(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tokenizer_dir: str
) -> None:
    n = 12
    config = reward_config(kafka_bootstrap, redis_url, unique_name, tokenizer_dir)
    names = TopicNames.of(config)
    rejected = SampleRejected(task_id="p:0:99", sample_idx=0, group_size=1, reason="workflow_none")
    values = [(f"p:0:{i}".encode(), encode(episode(i))) for i in range(n)]
    values += [(b"garbage", b"\xc1not msgpack"), (b"p:0:99", encode(rejected))]
    await produce_episodes(config, values)

    stop = asyncio.Event()
    worker = asyncio.create_task(run(config, stop))
    try:
        scored = await wait_for_scored(config, n + 2)
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)

    episodes = [m for m in scored if isinstance(m, ScoredEpisode)]
    assert len(scored) == n + 2 and [m for m in scored if isinstance(m, SampleRejected)] == [rejected]
    # the undecodable record's group is told at once (by its key), not left to time out
    [failure] = [m for m in scored if isinstance(m, TaskFailed)]
    assert failure.task_id == "garbage" and "undecodable" in failure.reason
    assert sorted(m.episode.task_id for m in episodes) == sorted(f"p:0:{i}" for i in range(n))
    for message in episodes:
        i = int(message.episode.task_id.rsplit(":", 1)[1])
        assert message.reward == expected_reward(i) and message.scored_by == "w-1"
        tensors = decode_tensor_dict(message.episode.trajectory)
        assert tensors.pop("rewards").tolist() == [expected_reward(i)]
        original = trajectory(i)
        assert tensors.keys() == original.keys()
        assert all(torch.equal(tensors[k], original[k]) for k in original)

    letters = await read_topic(config, names.dead_letter, decode_dead_letter)
    assert [(d.key, d.value, d.tier) for d in letters] == [(b"garbage", b"\xc1not msgpack", "reward-worker")]
    assert letters[0].reason and letters[0].source_topic == names.episodes

    assert await group_offsets(config) == await end_offsets(config, names.episodes)


async def group_offsets(config: RollstreamConfig) -> dict[TopicPartition, int]:
    admin = make_admin(config.kafka)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(TopicNames.of(config).group_id("reward-worker"))
    finally:
        await admin.close()
    return {tp: meta.offset for tp, meta in offsets.items() if meta.offset >= 0}


async def end_offsets(config: RollstreamConfig, topic: str) -> dict[TopicPartition, int]:
    consumer = make_consumer(config.kafka, "test-ends", group_id=None)
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(config.kafka.partitions)]
        return {tp: end for tp, end in (await consumer.end_offsets(parts)).items() if end > 0}
    finally:
        await consumer.stop()


async def test_a_fenced_partition_is_given_up_then_taken_back_without_loss_or_duplicates(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tokenizer_dir: str
) -> None:
    """Another producer registers the partitions' transactional ids (as a new owner would):
    the worker's next transactions are fenced, it publishes nothing for those partitions and
    does not exit; once the hold (2 x session timeout) passes and the group still assigns
    them to it, it takes them back (fencing the other) and scores the rest exactly once."""
    config = reward_config(kafka_bootstrap, redis_url, unique_name, tokenizer_dir)
    names = TopicNames.of(config)
    await produce_episodes(config, [(f"p:0:{i}".encode(), encode(episode(i))) for i in range(3)])
    worker = asyncio.create_task(run(config, asyncio.Event()))
    try:
        await wait_for_scored(config, 3)
        for p in range(config.kafka.partitions):
            usurper = make_producer(config.kafka, "usurper", transactional_id=f"{names.group_id('reward-worker')}.p{p}")
            await usurper.start()
            await usurper.stop()
        await produce_episodes(config, [(f"p:0:{i}".encode(), encode(episode(i))) for i in range(3, 6)])
        await asyncio.sleep(6.0)  # within the 12 s hold: fenced, nothing more published
        assert len(await read_topic(config, names.scored, decode_scored)) == 3
        assert not worker.done()
        scored = await wait_for_scored(config, 6, timeout=60.0)
        await asyncio.sleep(1.0)
        scored = await read_topic(config, names.scored, decode_scored)
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
    assert sorted(m.episode.task_id for m in scored) == [f"p:0:{i}" for i in range(6)]


def worker_process(config: RollstreamConfig, tokenizer: str, log_path: Path) -> TierProcess:
    """``rollstream reward-worker`` with no config file, every setting on the command line; not started."""
    settings = {
        "kafka.bootstrap_servers": config.kafka.bootstrap_servers,
        "kafka.partitions": config.kafka.partitions,
        "kafka.transaction_timeout_ms": config.kafka.transaction_timeout_ms,
        "redis.url": config.redis.url,
        "experiment.experiment_name": config.experiment.experiment_name,
        "experiment.trial_name": config.experiment.trial_name,
        "reward.reward_fn": "tests.integration.reward_service_fns:slow_exact_match",
        "reward.tokenizer_path": tokenizer,
        "reward.max_batch": 4,
        "reward.max_workers": 2,
        "reward.timeout_seconds": 60,
        "reward.worker_id": "w-stable",
        "reward.session_timeout_ms": 6000,
    }
    return TierProcess("reward-worker", None, log_path, overrides=[f"{k}={v}" for k, v in settings.items()])


@pytest.mark.slow
async def test_killed_worker_restarted_with_same_id_scores_each_episode_exactly_once(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tokenizer_dir: str, tmp_path: Path
) -> None:
    n = 40
    # 0.1 s per score: the kill lands mid-stream however fast the worker and slow this reader are
    config = reward_config(kafka_bootstrap, redis_url, unique_name, tokenizer_dir,
                           reward_fn="tests.integration.reward_service_fns:slow_exact_match")
    await produce_episodes(config, [(f"p:0:{i}".encode(), encode(episode(i))) for i in range(n)])
    log_path = tmp_path / "worker.log"

    worker = worker_process(config, tokenizer_dir, log_path).start()
    try:
        seen = await wait_for_scored(config, 4)
    finally:
        worker.kill()
    assert len(seen) < n, "the worker finished before it could be killed; use more episodes"

    worker.start()  # the same worker id again
    try:
        scored = await wait_for_scored(config, n, timeout=120)
        await asyncio.sleep(1.0)  # anything extra (a duplicate) would show up now
        scored = await read_topic(config, TopicNames.of(config).scored, decode_scored)
    finally:
        code = worker.stop(60)
    assert code == 0, worker.tail()

    keys = [(m.episode.task_id, m.episode.sample_idx) for m in scored]
    assert len(keys) == len(set(keys)) == n
    assert all(m.reward == expected_reward(int(m.episode.task_id.rsplit(":", 1)[1])) for m in scored)
    assert await group_offsets(config) == await end_offsets(config, TopicNames.of(config).episodes)


@pytest.mark.slow
async def test_worker_survives_a_broker_restart_without_loss_or_duplicates(
    dev_stack: Any, kafka_bootstrap: str, redis_url: str, unique_name: str, tokenizer_dir: str
) -> None:
    broker = dev_stack.broker
    if broker is None:
        pytest.skip("KAFKA_BOOTSTRAP_SERVERS points at an external broker: cannot restart it")
    n = 30
    config = reward_config(
        kafka_bootstrap, redis_url, unique_name, tokenizer_dir, max_batch=4, max_workers=2,
        reward_fn="tests.integration.reward_service_fns:slow_exact_match",
    )
    await produce_episodes(config, [(f"p:0:{i}".encode(), encode(episode(i))) for i in range(n)])
    stop = asyncio.Event()
    worker = asyncio.create_task(run(config, stop))
    try:
        await wait_for_scored(config, 4)
        await asyncio.to_thread(broker.restart)
        scored = await wait_for_scored(config, n, timeout=150)
        await asyncio.sleep(1.0)
        scored = await read_topic(config, TopicNames.of(config).scored, decode_scored)
        assert not worker.done(), "the worker gave up during the restart"
    finally:
        stop.set()
        await asyncio.wait_for(worker, 60)
    keys = [(m.episode.task_id, m.episode.sample_idx) for m in scored]
    assert len(keys) == len(set(keys)) == n


async def test_a_rebalance_while_a_batch_is_in_hand_skips_no_record_and_stalls_no_group(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tokenizer_dir: str
) -> None:
    """A second worker joins, then leaves, while the first is scoring a fetched batch (each
    reward takes 0.1 s, four per batch, one pool process): every episode is scored exactly
    once, and all of them within the deadline with no further membership change (a record
    stranded past the consumer's position would never be scored)."""
    n = 48
    settings = {"reward_fn": "tests.integration.reward_service_fns:slow_exact_match", "max_batch": 4,
                "poll_timeout_ms": 100}
    configs = [reward_config(kafka_bootstrap, redis_url, unique_name, tokenizer_dir, worker_id=w, **settings)
               for w in ("w-a", "w-b")]
    names = TopicNames.of(configs[0])
    await produce_episodes(configs[0], [(f"p:0:{i}".encode(), encode(episode(i))) for i in range(n)])
    stops = [asyncio.Event(), asyncio.Event()]
    a = asyncio.create_task(run(configs[0], stops[0]))
    b: asyncio.Task[None] | None = None
    try:
        await wait_for_scored(configs[0], 4)  # A is streaming: its next batch is in hand
        b = asyncio.create_task(run(configs[1], stops[1]))
        await wait_for_scored(configs[0], 16)
        stops[1].set()  # B leaves while A holds a batch: its partitions move back
        await asyncio.wait_for(b, 60)
        scored = await wait_for_scored(configs[0], n, timeout=60)
        await asyncio.sleep(1.0)
        scored = await read_topic(configs[0], names.scored, decode_scored)
    finally:
        for stop in stops:
            stop.set()
        await asyncio.wait_for(a, 60)
    assert sorted(m.episode.task_id for m in scored) == sorted(f"p:0:{i}" for i in range(n))


WORKFLOW_REWARDS = [  # (dtype, value): rewards a workflow set itself, in the dtypes the wire carries
    (torch.bfloat16, 0.75), (torch.float16, -1.5), (torch.bool, True), (torch.int8, 3), (torch.float64, 0.1),
]


def scored_by_workflow(i: int, value: torch.Tensor) -> Episode:
    return Episode(task_id=f"p:0:{i}", sample_idx=0, group_size=1, has_reward=True, data={"answer": "five"},
                   trajectory=encode_tensor_dict({**trajectory(i), "rewards": value.reshape(1)}))


async def test_workflow_rewards_of_every_wire_dtype_pass_through_and_a_nan_one_fails_alone(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tokenizer_dir: str
) -> None:
    """Rewards the workflow set are read as float32 whatever their wire dtype (as torch's
    ``.to(torch.float32)`` reads them); a NaN one fails its sample; the records behind it on the
    same partition are scored."""
    config = reward_config(kafka_bootstrap, redis_url, unique_name, tokenizer_dir)
    config.kafka.partitions = 1
    values = [scored_by_workflow(i, torch.tensor(v, dtype=dtype)) for i, (dtype, v) in enumerate(WORKFLOW_REWARDS)]
    nan = scored_by_workflow(len(values), torch.tensor(float("nan"), dtype=torch.float16))
    behind = episode(len(values) + 1)
    records = [(m.task_id.encode(), encode(m)) for m in [*values, nan, behind]]
    await produce_episodes(config, records)

    stop = asyncio.Event()
    worker = asyncio.create_task(run(config, stop))
    try:
        scored = await wait_for_scored(config, len(records))
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)

    by_task = {(m.episode.task_id if isinstance(m, ScoredEpisode) else m.task_id): m for m in scored}
    assert len(scored) == len(records) == len(by_task)
    for i, (dtype, v) in enumerate(WORKFLOW_REWARDS):
        message = by_task[f"p:0:{i}"]
        want = torch.tensor(v, dtype=dtype).to(torch.float32).item()
        assert isinstance(message, ScoredEpisode) and message.reward_source == "workflow", dtype
        assert message.reward == want, (dtype, message.reward, want)
        assert decode_tensor_dict(message.episode.trajectory)["rewards"].tolist() == [want]
    failed = by_task[nan.task_id]
    assert isinstance(failed, SampleRejected) and failed.failed and "non-finite" in failed.reason
    last = by_task[behind.task_id]
    assert isinstance(last, ScoredEpisode) and last.reward == expected_reward(len(values) + 1)

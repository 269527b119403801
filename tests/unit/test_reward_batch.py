"""One poll batch: decoding, dead letters, offsets, outcomes (no broker)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from reward_workers.batch import describe_outcomes, first_offsets, outcome_of, score_batch, task_id_of
from reward_workers.rebalance import BatchGuard
from rollstream.wire import Episode, SampleRejected, ScoredEpisode, TaskFailed, encode, encode_tensor_dict

TOPIC = "rs.x.t0.episodes"


class ConstantScorer:
    worker_id = "w"
    on_timeout = "zero"
    rescore = False

    def passed_through(self, episode: Episode) -> None:
        pass

    def decode(self, ids: list[int]) -> str:
        return ""

    async def reward(self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                     data: dict[str, Any]) -> float:
        return float(len(completion_ids))


def record(partition: int, offset: int, value: bytes | None) -> ConsumerRecord:
    return ConsumerRecord(TOPIC, partition, offset, 0, 0, b"k", value, None, 1, len(value or b""), ())


def episode_bytes(task_id: str, completion: int) -> bytes:
    traj = {
        "input_ids": torch.arange(2 + completion, dtype=torch.int32)[None],
        "attention_mask": torch.ones(1, 2 + completion, dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 0] + [1] * completion], dtype=torch.int32),
    }
    return encode(Episode(task_id=task_id, sample_idx=0, group_size=1, trajectory=encode_tensor_dict(traj)))


async def test_batch_decodes_scores_and_dead_letters() -> None:
    rejected = SampleRejected(task_id="c", sample_idx=0, group_size=1)
    fetched = {
        TopicPartition(TOPIC, 0): [record(0, 5, episode_bytes("a", 3)), record(0, 6, b"\x00garbage")],
        TopicPartition(TOPIC, 1): [record(1, 9, episode_bytes("b", 1)), record(1, 10, encode(rejected))],
        TopicPartition(TOPIC, 2): [],
    }
    batch = await score_batch(fetched, ConstantScorer())
    assert batch.records == 4
    assert batch.offsets == {TopicPartition(TOPIC, 0): 7, TopicPartition(TOPIC, 1): 11}
    assert [task_id_of(r) for r in batch.results] == ["a", "b", "c"]
    assert [r.reward for r in batch.results if isinstance(r, ScoredEpisode)] == [3.0, 1.0]
    assert batch.results[2] == rejected
    [letter] = batch.dead_letters
    assert (letter.source_topic, letter.partition, letter.offset, letter.tier) == (TOPIC, 0, 6, "reward-worker")
    assert letter.value == b"\x00garbage" and letter.reason
    # A failed batch is retried from each partition's first fetched record.
    assert first_offsets(fetched) == {TopicPartition(TOPIC, 0): 5, TopicPartition(TOPIC, 1): 9}


def test_outcome_labels() -> None:
    rejected = SampleRejected(task_id="a", sample_idx=0, group_size=1)
    failed = SampleRejected(task_id="a", sample_idx=0, group_size=1, failed=True)
    episode = Episode(task_id="a", sample_idx=0, group_size=1, trajectory={})
    scored = ScoredEpisode(episode=episode, reward=1.0)
    kept = ScoredEpisode(episode=episode, reward=1.0, reward_source="workflow")
    assert outcome_of(rejected) == "rejected" and outcome_of(failed) == "failed"
    assert outcome_of(TaskFailed(task_id="a")) == "task_failed"
    assert outcome_of(scored) == "scored" and outcome_of(kept) == "passed_through"
    assert describe_outcomes([kept, scored, kept, failed]) == (
        "1 scored, 2 passed through (already scored by their workflow), 1 failed"
    )
    assert describe_outcomes([]) == "nothing"


async def test_revocation_waits_for_the_batch_in_progress() -> None:
    guard = BatchGuard()
    events: list[str] = []

    async def batch() -> None:
        async with guard.lock:
            events.append("batch start")
            await asyncio.sleep(0.05)
            events.append("batch committed")

    running = asyncio.create_task(batch())
    await asyncio.sleep(0)  # the batch holds the lock
    before = guard.generation
    await guard.on_partitions_revoked({TopicPartition(TOPIC, 0)})
    events.append("revoked")
    await running
    assert events == ["batch start", "batch committed", "revoked"]
    assert guard.generation == before + 1
    await guard.on_partitions_assigned(set())
    assert guard.generation == before + 2

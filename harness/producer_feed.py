"""A producer tier's config, dataset and published prompts, for the producer's integration tests."""

from __future__ import annotations

import asyncio
from pathlib import Path
import json
from typing import Any

import redis.asyncio as aioredis

from harness.configs import make_config
from harness.ledger import read_records
from rollstream.config import RollstreamConfig
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.topics import TopicNames
from rollstream.kafka.transactions import TransactionalProducer
from rollstream.producers.admission import Admission
from rollstream.producers.budget_restore import restore_budget
from rollstream.producers.cursor import advance
from rollstream.producers.publisher import PendingBatch, PromptPublisher, transactional_id
from rollstream.retry import RetryPolicy
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys
from rollstream.wire import ProducerCursor, PromptTask, encode
from rollstream.wire import decode_prompt


def write_dataset(path: Path, n: int) -> str:
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(n)))
    return str(path)


def producer_config(
    kafka_bootstrap: str, redis_url: str, name: str, dataset: str, **producer: Any
) -> RollstreamConfig:
    staleness = producer.pop("staleness", {"groups_per_step": 1000})
    sections = {
        "producer": {"dataset": dataset, "group_size": 3, "admission_poll_seconds": 0.2, **producer},
        "staleness": staleness,
    }
    return make_config(kafka_bootstrap, redis_url, name, sections)



async def read_prompts(config: RollstreamConfig) -> list[tuple[bytes, PromptTask]]:
    """Every committed prompt (all partitions; settled: the producer's last commit markers
    may land after its commit returned)."""
    records = await read_records(config.kafka, TopicNames.of(config).prompts, settled=True)
    return [(r.key, decode_prompt(r.value)) for r in records]


STEP_GROUPS = 4  # staleness.groups_per_step; eta 0: capacity 4 at version 0


class Producer:
    """One producer's real pieces (admission, transactional producer, publisher), driven by hand."""

    def __init__(self, config: RollstreamConfig, redis: aioredis.Redis) -> None:
        self.config = config
        self.names = TopicNames.of(config)
        self.budget = budget_of(config, redis)
        self.stop = asyncio.Event()
        self.admission = Admission(
            self.budget, redis, 0.2, self.stop, restore=lambda: restore_budget(config, self.names, self.budget)
        )
        pid = config.producer.producer_id
        self.txn = TransactionalProducer(config.kafka, f"test-{pid}", transactional_id(self.names, pid))
        self.publisher = PromptPublisher(self.txn, self.names, RetryPolicy(initial=0.1, max_attempts=3), self.admission)
        self.cursor = ProducerCursor(producer_id=pid, epoch=0, index=0, published=0)

    async def start(self) -> None:
        """What run_producer does first: topics, generation, producer, the initial cursor."""
        await ensure_topics(self.config.kafka, self.names)
        await self.admission.begin()
        await self.txn.start()
        await self.publisher.commit(PendingBatch(cursor=self.cursor))

    async def admit(self, n: int) -> PendingBatch:
        """Admit ``n`` train prompts into a pending batch (not committed)."""
        batch = PendingBatch()
        pid = self.config.producer.producer_id
        for index in range(n):
            task = PromptTask(task_id=f"{pid}:0:{index}", group_size=2, data={"q": index})
            assert await self.admission.try_admit(task.task_id, is_eval=False)
            batch.add_prompt(task, encode(task), advance(self.cursor, 0, index + 1, index + 1))
        return batch


def budget_of(config: RollstreamConfig, redis: aioredis.Redis) -> StalenessBudget:
    keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
    return StalenessBudget(redis, keys, config.staleness.max_head_offpolicyness, config.staleness.groups_per_step)


async def committed_train_prompts(config: RollstreamConfig) -> int:
    return sum(not task.is_eval for _, task in await read_prompts(config))

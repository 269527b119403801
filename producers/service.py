"""The producer tier, declared: dataset rows -> admitted prompts on the ``prompts`` topic, a
source tier (:class:`~rollstream.producers.prompt_source.PromptSource` does the publishing).

For each sample from the committed cursor on, the producer derives a deterministic task id
``"{producer_id}:{epoch}:{index}"``, admits it through the staleness budget (eval prompts
skip admission), and publishes the ``PromptTask`` plus the advanced cursor in one Kafka
transaction (several prompts per transaction). It returns when the dataset is exhausted
(burst style), when ``producer.max_prompts`` prompts were published in total (counted across
restarts through the cursor), or when ``stop`` is set (after committing what it admitted).

A row that cannot become a prompt record is dead-lettered (with the reason) and skipped, the
cursor moving past it: a row that cannot be encoded, an image that is not one, or a record
larger than ``kafka.max_message_bytes`` (the reason gives its size, its images' sizes and the
limit), which no retry could ever write. A row's images travel as encoded files
(``producers/prompt_images.py``).
"""

from __future__ import annotations

import asyncio

from rollstream.producers.admission import Admission
from rollstream.producers.budget_restore import restore_budget
from rollstream.producers.dataset import load_rows
from rollstream.producers.prompt_source import PromptSource, RunSummary
from rollstream.producers.publisher import TIER, PromptPublisher, transactional_id
from rollstream.config import RollstreamConfig, require
from rollstream.kafka.transactions import TransactionalProducer
from rollstream.state.budget import StalenessBudget
from rollstream.retry import KAFKA_RETRY
from rollstream.tier.context import TierContext
from rollstream.tier.declaration import SOURCE, Tier
from rollstream.tier.runtime import entry, serve

# failed transactions in a row before the producer gives up, once they went on for
# kafka.outage_patience_seconds
PUBLISH_ATTEMPTS = 20


def check_config(config: RollstreamConfig) -> None:
    """What the producer needs beyond the schema's rules (which the types carry)."""
    require(config.producer.dataset, "producer.dataset", "must name a JSONL, Parquet or HF dataset path")


def declare(config: RollstreamConfig) -> Tier:
    check_config(config)
    return Tier(TIER, config.producer.producer_id, None, ("prompts", "producer-cursor"), SOURCE, build)


async def build(ctx: TierContext) -> PromptSource:
    """The dataset's rows, the transactional producer, and the staleness budget's admission."""
    config, pc = ctx.config, ctx.config.producer
    ctx.phase = f"loading the dataset {pc.dataset}"
    rows = await asyncio.to_thread(load_rows, pc.dataset, pc.dataset_format, pc.split)
    txn = TransactionalProducer(config.kafka, ctx.tier.client_id, transactional_id(ctx.names, pc.producer_id))
    ctx.on_close("stopping the transactional producer", txn.stop)
    budget = StalenessBudget(await ctx.redis(), ctx.keys, config.staleness.max_head_offpolicyness,
                             config.staleness.groups_per_step)
    admission = Admission(
        budget, await ctx.redis(), pc.admission_poll_seconds, ctx.stop, enabled=config.staleness.enabled,
        restore=lambda: restore_budget(config, ctx.names, budget), counts=not pc.is_eval,
    )
    publisher = PromptPublisher(txn, ctx.names, KAFKA_RETRY.limited(PUBLISH_ATTEMPTS, config.kafka.outage_patience_seconds),
                                admission)
    return PromptSource(config, ctx.names, rows, txn, admission, publisher)


run = entry(declare)


async def run_producer(config: RollstreamConfig, stop: asyncio.Event) -> RunSummary:
    """:func:`run`, returning the summary of what was published (for tests and tools)."""
    summary: RunSummary = await serve(declare(config), config, stop)
    return summary

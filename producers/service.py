"""The producer tier, declared: a source tier whose
:class:`~rollstream.producers.prompt_source.PromptSource` publishes dataset rows as admitted
prompts with the dataset cursor, until the dataset or ``producer.max_prompts`` is exhausted,
or ``stop``."""

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

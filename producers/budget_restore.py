"""Rebuild the staleness budget's counters in Redis from the topics.

Redis holds the counters (``admitted``, ``dropped``) that bound admission; a Redis restarted
without persistence has lost them, and zeroed counters would let producers admit a whole new
budget on top of the prompts in flight. The topics hold every admission and outcome, so a
producer that finds the state missing (``StateMissingError``) rebuilds it, once across all
producers (a lock in Redis), before anything is admitted again:

- admitted: the train prompts committed on ``prompts`` (their task ids, which also become the
  idempotency markers), or the sum of the non-eval producers' cursors' ``published`` counts
  when that is larger (retention may have deleted old prompts; the compacted cursor topic
  keeps every producer's total);
- dropped: the ``dropped`` records on ``batches`` of those train tasks, by reason.

Prompts admitted before the loss and committed after this scan are counted by the producers'
``confirm`` after each commit (idempotent per task), so the counters end exact. The same
rebuild initialises the counters of a new trial (empty topics: zero).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid

from rollstream.producers.cursor import read_all_cursors
from rollstream.config import RollstreamConfig
from rollstream.kafka.scan import scan_topic
from rollstream.kafka.topics import TopicNames
from rollstream.redis_state import StalenessBudget
from rollstream.wire import GroupDropped, WireDecodeError, decode_batch, decode_prompt

log = logging.getLogger(__name__)

LOCK_TTL_SECONDS = 300
LOCK_POLL_SECONDS = 0.5


async def restore_budget(config: RollstreamConfig, names: TopicNames, budget: StalenessBudget) -> None:
    """Return once the budget has its state: rebuilt here, or by another producer meanwhile."""
    owner = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    while not await budget.has_state():
        if not await budget.try_lock(owner, LOCK_TTL_SECONDS):
            await asyncio.sleep(LOCK_POLL_SECONDS)  # another producer is rebuilding
            continue
        try:
            await _rebuild(config, names, budget)
        finally:
            await budget.unlock(owner)


async def _rebuild(config: RollstreamConfig, names: TopicNames, budget: StalenessBudget) -> None:
    started = time.monotonic()
    log.warning("the staleness budget has no state in Redis: rebuilding it from %s and %s", names.prompts, names.batches)
    admitted = await admitted_tasks(config, names)
    drops = await dropped_tasks(config, names, set(admitted))
    cursors = await read_all_cursors(config, names)
    from_cursors = sum(c.published for c in cursors.values() if not c.is_eval)
    count = max(len(admitted), from_cursors)
    if await budget.restore(admitted, drops, admitted_count=count, note="rebuilt from the topics"):
        log.warning(
            "staleness budget rebuilt in %.1fs: admitted %d (%d prompts on the topic, %d by the cursors), dropped %d",
            time.monotonic() - started, count, len(admitted), from_cursors, len(drops),
        )


async def admitted_tasks(config: RollstreamConfig, names: TopicNames) -> list[str]:
    """Task ids of the committed train prompts, in topic order, each once."""
    seen: dict[str, None] = {}
    async for record in scan_topic(config.kafka, names.prompts, "budget-restore-prompts"):
        try:
            task = decode_prompt(record.value)
        except WireDecodeError:
            continue  # never admitted: producers publish only what they encoded
        if not task.is_eval:
            seen.setdefault(task.task_id, None)
    return list(seen)


async def dropped_tasks(config: RollstreamConfig, names: TopicNames, train: set[str]) -> dict[str, str]:
    """task id -> drop reason of the committed drops of ``train`` tasks."""
    drops: dict[str, str] = {}
    async for record in scan_topic(config.kafka, names.batches, "budget-restore-batches"):
        try:
            message = decode_batch(record.value)
        except WireDecodeError:
            continue
        if isinstance(message, GroupDropped) and message.task_id in train:
            drops.setdefault(message.task_id, message.reason)
    return drops

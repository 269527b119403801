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

Before it reads anything it FENCES every train producer of the trial (registers each one's
transactional id, found on the cursor topic: a producer commits a cursor before its first
admission). That aborts the transactions they have open and makes every producer they hold
unable to commit, so no prompt admitted before the loss can be committed after the scan:
the producers find the budget's generation changed and start again from their committed
cursors, admitting those prompts anew (producers/admission.py). The scans therefore see
every prompt that will ever be committed from an old admission, and the counters are exact
when they are written (docs/GUARANTEES.md, section 13). The same rebuild initialises the
counters of a new trial (empty topics: zero).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid

from rollstream.producers.cursor import read_all_cursors
from rollstream.producers.publisher import transactional_id
from rollstream.config import RollstreamConfig
from rollstream.kafka.clients import start_client
from rollstream.kafka.scan import scan_topic
from rollstream.kafka.topics import TopicNames
from rollstream.kafka.transactions import TransactionalProducer
from rollstream.state.budget import StalenessBudget
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
    train = sorted(pid for pid, c in (await read_all_cursors(config, names)).items() if not c.is_eval)
    await fence_producers(config, names, train)
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


async def fence_producers(config: RollstreamConfig, names: TopicNames, producer_ids: list[str]) -> None:
    """Register each producer's transactional id: its open transaction is aborted (Kafka
    completes that before answering) and it can never commit with its current producer."""
    for producer_id in producer_ids:
        fence = TransactionalProducer(config.kafka, f"budget-fence-{producer_id}", transactional_id(names, producer_id))
        await start_client(fence, config.kafka, f"fencing producer {producer_id}")
        await fence.stop()
    if producer_ids:
        log.warning("fenced the train producers %s: they start again from their committed cursors", producer_ids)


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

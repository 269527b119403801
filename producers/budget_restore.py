"""Rebuild the staleness budget's counters in Redis from the durable facts.

Redis holds the counters that bound admission. A Redis restarted without persistence has
lost them, and one that came back with an earlier moment's state (a restart from its last
snapshot, an append-only file that lost its last second, a failover to a lagging replica)
holds counters lower than the truth; either would let producers admit a new budget on top of
the prompts in flight. The budget's scripts refuse both (its state is missing, or stamped
with another redis-server process: ``rollstream.state.epoch``), and a producer that meets
that rebuilds it here, once across all producers (a lock in Redis, renewed while it works and
taken over only on a process that did not see it taken), before anything is admitted again:

- admitted: the train prompts committed on ``prompts`` (their task ids, which also become the
  idempotency markers), or the sum of the non-eval producers' cursors' ``published`` counts
  when that is larger (retention may have deleted old prompts; the compacted cursor topic
  keeps every producer's total);
- dropped: the ``dropped`` records on ``batches`` of those train tasks, by reason;
- trainer_dropped: the trainer's count of groups it dropped as stale, from the metadata its
  consumer group committed (``rollstream.kafka.trainer_commits``);
- version_floor: the newest trainer version tagged on ``batches`` (a version the trainer
  reached: the capacity never uses a version Redis forgot, but never more than the truth).

Before it reads anything it FENCES every producer of the trial, eval ones too (registers
each one's transactional id, found on the cursor topic: a producer commits a cursor before
its first admission; a producer restarted as train keeps an eval cursor until it commits
again). That aborts the transactions they have open and makes every producer they hold unable
to commit, so no prompt admitted before the loss can be committed after the scan: the
producers find the budget's generation changed and start again from their committed cursors,
admitting those prompts anew (producers/admission.py). The topics are then read, committed
records only, to their HIGH WATERMARKS taken after the fence: a transaction still open below
that end (another tier's, or one the fence could not know) is waited for, never read past,
so every record committed before the fence is seen. The counters are exact when they are
written (docs/GUARANTEES.md, sections 2 and 16). The same rebuild initialises the counters of
a new trial (empty topics: zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import Awaitable

from redis.exceptions import RedisError

from rollstream.config import RollstreamConfig
from rollstream.kafka.clients import start_client, stop_client
from rollstream.kafka.scan import high_watermarks, scan_topic
from rollstream.kafka.topics import TopicNames
from rollstream.kafka.trainer_commits import committed_stale_drops
from rollstream.kafka.transactions import TransactionalProducer
from rollstream.producers.cursor import read_all_cursors
from rollstream.producers.publisher import transactional_id
from rollstream.state.budget import RebuildInterrupted, RebuiltCounts, StalenessBudget
from rollstream.wire import EmittedGroup, GroupDropped, WireDecodeError, decode_group, decode_prompt

log = logging.getLogger(__name__)

LOCK_TTL_SECONDS = 30.0  # renewed every third of it while the rebuild runs
LOCK_POLL_SECONDS = 0.5
READ_STALL_SECONDS = 30.0  # on top of the transaction timeout: an open transaction ends by then


async def restore_budget(config: RollstreamConfig, names: TopicNames, budget: StalenessBudget) -> None:
    """Return once the budget has a valid state: rebuilt here, or by another producer meanwhile.
    Redis errors propagate (the caller waits for Redis and calls again)."""
    holder = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    while not await budget.has_state():
        if await budget.lock(holder, LOCK_TTL_SECONDS) is None:
            await asyncio.sleep(LOCK_POLL_SECONDS)  # another producer is rebuilding
            continue
        try:
            await while_locked(budget, holder, rebuild(config, names, budget, holder))
        except RebuildInterrupted as exc:
            log.warning("the staleness budget's rebuild starts again: %s", exc)
        finally:
            with contextlib.suppress(RedisError, OSError):
                await budget.unlock(holder)


async def while_locked(budget: StalenessBudget, holder: str, work: Awaitable[None],
                       ttl_seconds: float = LOCK_TTL_SECONDS) -> None:
    """Run ``work`` while renewing ``holder``'s lock every third of its TTL; when a renewal is
    refused (or fails) the work is cancelled and :class:`RebuildInterrupted` (or the Redis
    error) raised: a rebuild never finishes on a lock it lost."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=ttl_seconds / 3)
            if done:
                return task.result()
            if not await budget.renew_lock(holder, ttl_seconds):
                raise RebuildInterrupted("the rebuild lock was lost (it expired, or Redis changed process)")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def rebuild(config: RollstreamConfig, names: TopicNames, budget: StalenessBudget, holder: str) -> None:
    started = time.monotonic()
    log.warning("the staleness budget in Redis is missing or was written by another redis-server process: "
                "rebuilding it from %s and %s", names.prompts, names.batches)
    producers = sorted(await read_all_cursors(config, names, end=await _ends(config, names.producer_cursor)))
    await fence_producers(config, names, producers)
    # Ends taken after the fence: everything committed before it is below them.
    ends = {topic: await _ends(config, topic) for topic in (names.producer_cursor, names.prompts, names.batches)}
    cursors = await read_all_cursors(config, names, end=ends[names.producer_cursor])
    admitted = await admitted_tasks(config, names, ends[names.prompts])
    drops, version_floor = await dropped_tasks(config, names, set(admitted), ends[names.batches])
    trainer_dropped = await committed_stale_drops(config.kafka, config.trainer.group_id, names.batches,
                                                  "budget-restore-trainer")
    from_cursors = sum(c.published for c in cursors.values() if not c.is_eval)
    counts = RebuiltCounts(admitted, drops, from_cursors, version_floor, trainer_dropped, "rebuilt from the topics")
    if await budget.restore(counts, lock_holder=holder):
        log.warning(
            "staleness budget rebuilt in %.1fs: admitted %d (%d prompts on the topic, %d by the cursors), "
            "dropped %d, dropped as stale by the trainer %d, version at least %d",
            time.monotonic() - started, max(len(admitted), from_cursors), len(admitted), from_cursors, len(drops),
            trainer_dropped, version_floor,
        )


async def _ends(config: RollstreamConfig, topic: str) -> dict[int, int]:
    return await high_watermarks(config.kafka, topic, "budget-restore-ends")


def _stall_seconds(config: RollstreamConfig) -> float:
    return config.kafka.transaction_timeout_ms / 1000 + READ_STALL_SECONDS


async def fence_producers(config: RollstreamConfig, names: TopicNames, producer_ids: list[str]) -> None:
    """Register each producer's transactional id: its open transaction is aborted (Kafka
    completes that before answering) and it can never commit with its current producer."""
    for producer_id in producer_ids:
        fence = TransactionalProducer(config.kafka, f"budget-fence-{producer_id}", transactional_id(names, producer_id))
        await start_client(fence, config.kafka, f"fencing producer {producer_id}")
        await stop_client(fence, f"the fence of producer {producer_id}")
    if producer_ids:
        log.warning("fenced the producers %s: they start again from their committed cursors", producer_ids)


async def admitted_tasks(config: RollstreamConfig, names: TopicNames, end: dict[int, int]) -> list[str]:
    """Task ids of the committed train prompts below ``end``, in topic order, each once."""
    seen: dict[str, None] = {}
    records = scan_topic(config.kafka, names.prompts, "budget-restore-prompts", end, _stall_seconds(config))
    async for record in records:
        try:
            task = decode_prompt(record.value)
        except WireDecodeError:
            continue  # never admitted: producers publish only what they encoded
        if not task.is_eval:
            seen.setdefault(task.task_id, None)
    return list(seen)


async def dropped_tasks(
    config: RollstreamConfig, names: TopicNames, train: set[str], end: dict[int, int],
) -> tuple[dict[str, str], int]:
    """``(task id -> drop reason of the committed drops of train tasks, the newest trainer
    version a group below ``end`` is tagged with)``."""
    drops: dict[str, str] = {}
    version = 0
    records = scan_topic(config.kafka, names.batches, "budget-restore-batches", end, _stall_seconds(config))
    async for record in records:
        try:
            message = decode_group(record.value)
        except WireDecodeError:
            continue
        if isinstance(message, GroupDropped) and message.task_id in train:
            drops.setdefault(message.task_id, message.reason)
        elif isinstance(message, EmittedGroup):
            version = max(version, message.trainer_version)
    return drops, version

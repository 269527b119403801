"""One poll batch of ``episodes`` records: decode, score, and commit in a single transaction.

``score_batch`` is broker-free: it turns records into ``scored`` messages and dead letters.
``commit_batch`` writes them together with the consumed offsets in one Kafka transaction
(consume-transform-produce), so a batch is either entirely visible to ``read_committed``
readers with its offsets committed, or not at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.structs import ConsumerRecord

from reward_workers.scoring import RewardScorer, ScoreResult, score_message
from rollstream.kafka.dead_letter import dead_letter_for, send_dead_letter
from rollstream.kafka.topics import TopicNames
from rollstream.metrics import DEAD_LETTERS, EPISODES, MESSAGES_IN, MESSAGES_OUT, REWARD
from rollstream.wire import (
    DeadLetter,
    SampleRejected,
    ScoredEpisode,
    TaskFailed,
    WireDecodeError,
    decode_episode,
    encode,
)

log = logging.getLogger(__name__)

TIER = "reward-worker"


@dataclass
class ScoredBatch:
    """What one poll batch becomes: scored messages, dead letters, and the offsets to commit."""

    results: list[ScoreResult] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    offsets: dict[TopicPartition, int] = field(default_factory=dict)  # next offset to read
    records: int = 0


def first_offsets(batches: dict[TopicPartition, list[ConsumerRecord]]) -> dict[TopicPartition, int]:
    """Where to seek to retry a failed batch: each partition's first fetched offset.

    Between batches a partition's position is the offset committed with its previous batch
    (read_committed skips only transaction markers and aborted records, which a retry would
    skip again), so this equals the committed offset, known without asking the broker,
    which may be the very thing that is unreachable.
    """
    return {tp: records[0].offset for tp, records in batches.items() if records}


def task_id_of(result: ScoreResult) -> str:
    return result.episode.task_id if isinstance(result, ScoredEpisode) else result.task_id


def outcome_of(result: ScoreResult) -> str:
    """Metric label: scored | passed_through (already scored by its workflow) | rejected |
    failed | task_failed."""
    match result:
        case ScoredEpisode(reward_source="workflow"):
            return "passed_through"
        case ScoredEpisode():
            return "scored"
        case SampleRejected(failed=True):
            return "failed"
        case SampleRejected():
            return "rejected"
        case TaskFailed():
            return "task_failed"
    raise TypeError(f"not a scored message: {type(result).__name__}")


def describe_outcomes(results: list[ScoreResult]) -> str:
    """``"3 scored, 13 passed through (already scored by their workflow), 1 failed"``: the
    batch's results by outcome, in a fixed order, zero counts left out ("nothing" if empty)."""
    counts = Counter(outcome_of(r) for r in results)
    labels = {"passed_through": "passed through (already scored by their workflow)"}
    order = ("scored", "passed_through", "rejected", "failed", "task_failed")
    return ", ".join(f"{counts[o]} {labels.get(o, o)}" for o in order if counts[o]) or "nothing"


async def score_batch(
    batches: dict[TopicPartition, list[ConsumerRecord]], scorer: RewardScorer
) -> ScoredBatch:
    """Decode every record (undecodable ones become dead letters) and score them concurrently."""
    out = ScoredBatch()
    messages = []
    for tp, records in batches.items():
        if not records:
            continue
        out.offsets[tp] = records[-1].offset + 1
        out.records += len(records)
        for record in records:
            try:
                messages.append(decode_episode(record.value))
            except WireDecodeError as exc:
                out.dead_letters.append(dead_letter_for(record, TIER, exc.reason, exc))
    out.results = list(await asyncio.gather(*(score_message(m, scorer) for m in messages)))
    return out


async def commit_batch(
    producer: AIOKafkaProducer, names: TopicNames, group_id: str, batch: ScoredBatch
) -> None:
    """Send results (keyed by task id) and dead letters, and commit the offsets, atomically.

    Raises on any failure; the transaction is then aborted and nothing of it is visible.
    """
    async with producer.transaction():
        futures = [
            await producer.send(names.scored, encode(result), key=task_id_of(result).encode())
            for result in batch.results
        ]
        for letter in batch.dead_letters:
            await send_dead_letter(producer, names.dead_letter, letter)
        await producer.send_offsets_to_transaction(batch.offsets, group_id)
        for future in futures:
            await future  # a delivery error raises here, inside the transaction, so it aborts
    _count(names, batch)


def _count(names: TopicNames, batch: ScoredBatch) -> None:
    MESSAGES_IN.labels(TIER, names.episodes).inc(batch.records)
    MESSAGES_OUT.labels(TIER, names.scored).inc(len(batch.results))
    MESSAGES_OUT.labels(TIER, names.dead_letter).inc(len(batch.dead_letters))
    DEAD_LETTERS.labels(TIER, "undecodable").inc(len(batch.dead_letters))
    for result in batch.results:
        EPISODES.labels(TIER, outcome_of(result)).inc()
        if isinstance(result, ScoredEpisode):
            REWARD.labels(TIER).observe(result.reward)

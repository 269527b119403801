"""What the reward tier does to one ``episodes`` record: decode, score, one ``scored`` message.

:class:`RewardTransform` is the tier's part of the shared consume-transform-produce loop
(:mod:`rollstream.kafka.consume_transform_produce`): it never sees a transaction. Every
record becomes exactly one ``scored`` message keyed by its task id (a ``ScoredEpisode``, or a
``SampleRejected``/``TaskFailed`` passed through or made by ``score_message``). A record that
cannot be handled is dead-lettered by the loop, and :meth:`RewardTransform.on_error` answers it
downstream so its group never waits for a sample that will not come: a decodable episode
becomes a failed ``SampleRejected`` naming the error, an undecodable record with a key becomes
a ``TaskFailed`` for that task id.
"""

from __future__ import annotations

import logging
from collections import Counter

from aiokafka.structs import ConsumerRecord

from rollstream.reward_workers.scoring import RewardScorer, ScoreResult, rejected_episode, score_message
from rollstream.kafka.consume_transform_produce import PartitionOutput, RecordTransform
from rollstream.kafka.topics import TopicNames
from rollstream.runtime.metrics import EPISODES, REWARD
from rollstream.wire import (
    Episode,
    SampleRejected,
    ScoredEpisode,
    TaskFailed,
    WireDecodeError,
    decode_episode,
    encode,
)

log = logging.getLogger(__name__)

TIER = "reward-worker"
MAX_REASON_CHARS = 500


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


def describe_outcomes(counts: Counter[str]) -> str:
    """``"3 scored, 13 passed through (already scored by their workflow), 1 failed"``: counts
    of :func:`outcome_of` labels in a fixed order, zero counts left out ("nothing" if empty)."""
    labels = {"passed_through": "passed through (already scored by their workflow)"}
    order = ("scored", "passed_through", "rejected", "failed", "task_failed")
    return ", ".join(f"{counts[o]} {labels.get(o, o)}" for o in order if counts[o]) or "nothing"


def failure_answer(record: ConsumerRecord, error: BaseException) -> ScoreResult | None:
    """The ``scored`` message that tells a dead-lettered record's group it failed (None: no
    task id to answer, the record has neither a decodable value nor a key)."""
    reason = f"{TIER} could not process the record: {type(error).__name__}: {error}"[:MAX_REASON_CHARS]
    try:
        message = decode_episode(record.value)
    except WireDecodeError:
        if record.key is None:
            return None
        return TaskFailed(task_id=record.key.decode("utf-8", "replace"), reason=reason)
    match message:
        case Episode():
            return rejected_episode(message, reason, failed=True)
        case _:
            return message


class RewardTransform(RecordTransform):
    """Scores episodes; records of a cycle are scored concurrently."""

    tier = TIER
    concurrent = True

    def __init__(self, names: TopicNames, scorer: RewardScorer) -> None:
        self._names = names
        self._scorer = scorer
        self.scored = 0  # records committed, for the stop log
        self._outcomes: dict[int, Counter[str]] = {}  # per partition, this cycle's results

    async def begin(self, records: dict[int, list[ConsumerRecord]]) -> None:
        self._outcomes = {partition: Counter() for partition in records}  # an aborted cycle's counts go

    async def transform(self, record: ConsumerRecord, out: PartitionOutput) -> None:
        result = await score_message(decode_episode(record.value), self._scorer)
        self._send(result, out)

    def on_error(self, record: ConsumerRecord, error: Exception, out: PartitionOutput) -> None:
        answer = failure_answer(record, error)
        if answer is not None:
            self._send(answer, out)

    async def committed(self, partition: int, out: PartitionOutput) -> None:
        self.scored += len(out.records)
        tasks = sorted({(r.key or b"-").decode("utf-8", "replace") for r in out.records})
        shown = ", ".join(tasks[:5]) + (f" (+{len(tasks) - 5} more)" if len(tasks) > 5 else "")
        log.info(
            "partition %d: committed %s; %d dead letters, offset %s; tasks %s",
            partition, describe_outcomes(self._outcomes.pop(partition, Counter())), len(out.dead_letters),
            out.offset, shown or "-", extra={"task_ids": tasks, "partition": partition},
        )

    def _send(self, result: ScoreResult, out: PartitionOutput) -> None:
        task_id = result.episode.task_id if isinstance(result, ScoredEpisode) else result.task_id
        out.send(self._names.scored, encode(result), key=task_id.encode())
        outcome = outcome_of(result)
        self._outcomes.setdefault(out.partition, Counter())[outcome] += 1
        EPISODES.labels(TIER, outcome).inc()
        if isinstance(result, ScoredEpisode):
            REWARD.labels(TIER).observe(result.reward)

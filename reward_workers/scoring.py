"""Scoring one ``episodes`` message: pure logic over a ``RewardScorer`` (no Kafka).

``score_message`` turns an ``Episode`` into a ``ScoredEpisode`` (or a ``SampleRejected`` when
the reward cannot be computed) and passes ``SampleRejected`` / ``TaskFailed`` through
unchanged. It never raises for a bad episode or a failing reward function: every outcome is
a message for the ``scored`` topic, so the group can still complete downstream.

The pre-scored rule: an episode whose workflow set ``rewards`` itself (``has_reward``) keeps
them and the reward function is not called (``reward_source="workflow"``), unless the scorer
re-scores on purpose (``reward.rescore``). So a pipeline whose workflows all score themselves
needs no reward function at all.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from typing import Any, Literal, Protocol

import msgspec
import numpy

from rollstream.rewards.pool import RewardTimeout
from rollstream.wire import (
    Episode,
    SampleRejected,
    ScoredEpisode,
    TaskFailed,
    decode_array,
    encode_array,
)
from rollstream.wire.dtypes import cast

# Names the reward function receives positionally; dataset keys with these names are not
# passed again as keyword arguments (that would be a TypeError in every call).
RESERVED_ARGS = frozenset({"prompt", "completion", "prompt_ids", "completion_ids"})

ScoreResult = ScoredEpisode | SampleRejected | TaskFailed

# The trajectory tensors scoring reads.
SCORING_KEYS = frozenset({"input_ids", "attention_mask", "loss_mask", "rewards"})


class RewardScorer(Protocol):
    """What ``score_message`` needs: text decoding, the reward call, the timeout policy, and
    whether episodes the workflow scored are re-scored (``rescore``)."""

    worker_id: str
    on_timeout: Literal["zero", "reject"]
    rescore: bool

    def passed_through(self, episode: Episode) -> None:
        """Told of each episode whose workflow's rewards were kept (to count and report it)."""

    def decode(self, ids: numpy.ndarray) -> str:
        """Text of ``ids`` (special tokens kept); "" when no tokenizer is configured."""

    def decode_prompt(self, ids: numpy.ndarray) -> str:
        """``decode(ids)`` for a prompt: the samples of a group share theirs, so the scorer may
        remember recent ones."""

    async def reward(
        self, prompt: str, completion: str, prompt_ids: numpy.ndarray, completion_ids: numpy.ndarray,
        data: dict[str, Any],
    ) -> float:
        """The reward; the function gets the ids as ``list[int]``. Raises ``RewardTimeout`` when
        every attempt timed out, or the function's error."""


def split_prompt_completion(
    trajectory: Mapping[str, Any], row: int = 0
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """``(prompt_ids, completion_ids)`` of one row of a ``[b, L]`` trajectory (numpy arrays, or
    CPU tensors), as numpy arrays.

    Only attended tokens (``attention_mask == 1``) count, so padding is never included.
    The prompt is every token before the first generated token (``loss_mask == 1``); the
    completion is every generated token. In a multi-turn trajectory the completion is all
    generated tokens of all turns, concatenated (tool/user tokens between turns, which have
    ``loss_mask == 0``, belong to neither). Without ``loss_mask`` or generated tokens, the
    whole row is the prompt and the completion is empty.

    numpy, not torch: boolean indexing in torch runs ``nonzero`` on its intra-op thread pool,
    which bench/pipeline.py found costing milliseconds per row on a busy machine; and the
    tokenizer decodes arrays faster than lists.
    """
    ids = numpy.asarray(trajectory["input_ids"][row])
    attended = numpy.asarray(trajectory["attention_mask"][row]).astype(bool, copy=False)
    loss_mask = trajectory.get("loss_mask")
    if loss_mask is None:
        return ids[attended], ids[:0]
    generated = numpy.asarray(loss_mask[row]).astype(bool, copy=False) & attended
    positions = numpy.flatnonzero(generated)
    if positions.size == 0:
        return ids[attended], ids[:0]
    first = int(positions[0])
    return ids[:first][attended[:first]], ids[generated]


async def score_message(
    message: Episode | SampleRejected | TaskFailed, scorer: RewardScorer
) -> ScoreResult:
    """The ``scored`` message for one ``episodes`` message (see the module docstring).

    An ``Episode`` gets ``trajectory["rewards"]`` (float32 ``[b]``) and ``reward`` (row 0's
    reward when ``b == 1``, else the mean over rows). With ``has_reward`` (and not
    ``scorer.rescore``) the workflow's rewards are kept and the reward function is not called.
    A timeout on the last attempt
    scores 0.0 (``on_timeout="zero"``) or rejects the sample with reason ``reward_timeout``
    (``"reject"``); any other failure rejects it with ``failed=True`` and reason
    ``"reward_error: ..."``.
    """
    match message:
        case Episode():
            keep = message.has_reward and not scorer.rescore
            try:
                rewards = await _episode_rewards(message, scorer, keep)
            except RewardTimeout:
                return rejected_episode(message, "reward_timeout", failed=False)
            except Exception as exc:  # noqa: BLE001 - a reward failure is a sample outcome
                return rejected_episode(message, f"reward_error: {type(exc).__name__}: {exc}", failed=True)
            if keep:
                scorer.passed_through(message)
            return _scored(message, rewards, scorer.worker_id, "workflow" if keep else "reward_fn")
        case _:
            return message


async def _episode_rewards(episode: Episode, scorer: RewardScorer, keep: bool) -> list[float]:
    # only the arrays scoring reads are built (each costs µs; a trajectory has 5-7); numpy
    # views of the record, no torch (its per-tensor overhead was a tenth of the tier's work)
    wire = {k: v for k, v in episode.trajectory.items() if k in SCORING_KEYS}
    tensors = {k: decode_array(v) for k, v in wire.items()}
    rows = int(tensors["input_ids"].shape[0])
    if keep:
        if "rewards" not in tensors:
            raise ValueError("has_reward is set but the trajectory has no 'rewards'")
        rewards = cast(tensors["rewards"], wire["rewards"].dtype, "float32").tolist()
    else:
        data = {k: v for k, v in episode.data.items() if k not in RESERVED_ARGS}
        if rows == 1:  # the common case: no task to gather
            rewards = [await _row_reward(tensors, 0, data, scorer)]
        else:
            rewards = list(await asyncio.gather(*(_row_reward(tensors, row, data, scorer) for row in range(rows))))
    bad = [r for r in rewards if not math.isfinite(r)]
    if bad:
        raise ValueError(f"non-finite reward {bad[0]}")
    return rewards


async def _row_reward(
    tensors: dict[str, numpy.ndarray], row: int, data: dict[str, Any], scorer: RewardScorer
) -> float:
    prompt_ids, completion_ids = split_prompt_completion(tensors, row)
    try:
        return float(await scorer.reward(
            scorer.decode_prompt(prompt_ids), scorer.decode(completion_ids), prompt_ids, completion_ids, data,
        ))
    except RewardTimeout:
        if scorer.on_timeout == "reject":
            raise
        return 0.0


def _scored(
    episode: Episode, rewards: list[float], worker_id: str, source: Literal["reward_fn", "workflow"]
) -> ScoredEpisode:
    # A new dict: the decoded message's tensors are read-only views of its buffer.
    trajectory = dict(episode.trajectory)
    trajectory["rewards"] = encode_array(numpy.asarray(rewards, dtype=numpy.float32))
    reward = rewards[0] if len(rewards) == 1 else sum(rewards) / len(rewards)
    return ScoredEpisode(
        episode=msgspec.structs.replace(episode, trajectory=trajectory),
        reward=float(reward),
        scored_by=worker_id,
        scored_at=time.time(),
        reward_source=source,
    )


def rejected_episode(episode: Episode, reason: str, failed: bool) -> SampleRejected:
    """The ``scored`` message that ends ``episode``'s sample as rejected (``failed``: it failed)."""
    return SampleRejected(
        task_id=episode.task_id,
        sample_idx=episode.sample_idx,
        group_size=episode.group_size,
        is_eval=episode.is_eval,
        reason=reason,
        failed=failed,
    )

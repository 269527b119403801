"""Which replayed messages to keep: task ids, tail-version range, eval flag, reward range.

A message that lacks the property a filter asks about never matches that filter: with a
version range set, prompts, rejections, failures, drops and dead letters are left out; with a
reward range set, everything but scored episodes, episodes whose workflow set ``rewards``,
and emitted groups (mean reward of their rows) is left out; dead letters have no eval flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollstream.dump.lines import message_rows
from rollstream.trajectory.staleness import head_and_tail
from rollstream.wire import (
    DeadLetter,
    EmittedGroup,
    Episode,
    ScoredEpisode,
    decode_array,
    group_arrays,
)
from rollstream.wire.dtypes import to_float32


def task_ids_of(message: Any) -> list[str]:
    """The task ids a message belongs to."""
    match message:
        case ScoredEpisode():
            return [message.episode.task_id]
        case DeadLetter():
            return [message.key.decode("utf-8", "replace")] if message.key else []
    task_id = getattr(message, "task_id", None)
    return [task_id] if task_id else []


def tail_version_of(message: Any) -> int | None:
    """Newest version over the generated tokens of an episode, scored episode or emitted group: the
    largest ``tail_version`` of its dump lines (``rollstream.trajectory.staleness``, the one
    computation the episode message and the dumps use); None for other messages."""
    rows = message_rows(message)
    return head_and_tail(row.span for row in rows).tail_version if rows else None


def reward_of(message: Any) -> float | None:
    match message:
        case ScoredEpisode():
            return message.reward
        case Episode():
            wire = message.trajectory.get("rewards")
            return float(to_float32(decode_array(wire)).mean()) if wire is not None else None
        case EmittedGroup():
            rewards = group_arrays(message).get("rewards")
            return float(to_float32(rewards).mean()) if rewards is not None and rewards.size else None
    return None


def is_eval_of(message: Any) -> bool | None:
    if isinstance(message, ScoredEpisode):
        return message.episode.is_eval
    value = getattr(message, "is_eval", None)
    return value if isinstance(value, bool) else None


@dataclass(frozen=True)
class RecordFilter:
    """All set conditions must hold (an unset one always holds)."""

    task_ids: frozenset[str] = field(default_factory=frozenset)
    min_version: int | None = None
    max_version: int | None = None
    is_eval: bool | None = None
    min_reward: float | None = None
    max_reward: float | None = None

    @property
    def active(self) -> bool:
        """True when some condition is set (so records must be decoded to be judged)."""
        return bool(self.task_ids) or any(
            value is not None
            for value in (self.min_version, self.max_version, self.is_eval, self.min_reward, self.max_reward)
        )

    def accepts(self, message: Any) -> bool:
        if self.task_ids and not self.task_ids.intersection(task_ids_of(message)):
            return False
        if self.min_version is not None or self.max_version is not None:
            version = tail_version_of(message)
            if version is None or not _within(version, self.min_version, self.max_version):
                return False
        if self.is_eval is not None and is_eval_of(message) is not self.is_eval:
            return False
        if self.min_reward is not None or self.max_reward is not None:
            reward = reward_of(message)
            if reward is None or not _within(reward, self.min_reward, self.max_reward):
                return False
        return True


def _within(value: float, low: float | None, high: float | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)

"""The turns of one agent episode, how they chain, their rewards, and the rows they become.

A :class:`Turn` is one generated answer: one choice of a chat completion, or one direct engine
call. A chat turn whose request's messages extend an earlier turn (its messages, then the
reply the endpoint returned for it, then anything new, with the same tools) is that turn's
child: its prompt is the parent's exact prompt + output tokens followed by the new tokens
only. Callers may rely on:

* :meth:`Conversation.parent_for` picks the turn with the longest matching history (the
  newest one on a tie); direct engine calls are never parents.
* :meth:`Conversation.export` gives one row per leaf turn (a turn no later turn extends), in
  the order the turns were recorded: the chain's tokens from its root, ``loss_mask`` 1
  exactly on tokens the model generated (``logprobs`` and ``versions`` from the engine), 0 on
  everything the template or the agent added (``logprobs`` 0.0, ``versions`` -1). The dtypes
  are those of single-turn RLVR rows (``rollstream.trajectory.rows``).
* Rewards: a turn's reward is set by completion id (every choice of it) or for the last
  completion; unset rewards count 0. A row's reward is the discounted return of its chain from
  its first turn, ``sum(turn_discount**i * reward_i)``: a reward given only at the end of an
  ``n``-turn conversation is multiplied by ``turn_discount`` once per turn before the last, as
  in the multi-turn workflow. When no turn has a reward, rows carry no ``rewards`` (the reward
  tier scores them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from rollstream.agent.messages import MessageKey
from rollstream.api.io_struct import ModelResponse
from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.trajectory.rows import TrajectoryBuilder


@dataclass(eq=False)
class Turn:
    """One answer of the model. ``history`` is ``None`` for a direct engine call."""

    completion_id: str
    choice: int
    new_prompt: list[int]  # the tokens this turn added before generating (the whole prompt for a root)
    response: ModelResponse
    parent: Turn | None = None
    history: list[MessageKey] | None = None  # the request's messages, then the reply returned
    settings: str = ""  # tools and template arguments the prompt was rendered with
    reward: float | None = None
    children: int = 0

    @property
    def full_ids(self) -> list[int]:
        """Prompt + output: what a child's prompt starts with."""
        return list(self.response.input_tokens) + list(self.response.output_tokens)

    def chain(self) -> list[Turn]:
        """This turn and its ancestors, oldest first."""
        turns: list[Turn] = []
        turn: Turn | None = self
        while turn is not None:
            turns.append(turn)
            turn = turn.parent
        return turns[::-1]


@dataclass
class Conversation:
    """Every turn of one episode, in the order they were recorded."""

    turns: list[Turn] = field(default_factory=list)

    def parent_for(self, messages: Sequence[MessageKey], settings: str) -> Turn | None:
        """The turn ``messages`` extend, if any (see the module docstring)."""
        best: Turn | None = None
        for turn in self.turns:
            history = turn.history
            if history is None or turn.settings != settings or len(history) > len(messages):
                continue
            if list(messages[: len(history)]) == history and (best is None or len(history) >= len(best.history or ())):
                best = turn
        return best

    def add(self, turn: Turn) -> None:
        if turn.parent is not None:
            turn.parent.children += 1
        self.turns.append(turn)

    def completion_ids(self) -> list[str]:
        return list(dict.fromkeys(t.completion_id for t in self.turns))

    def set_reward(self, reward: float, completion_id: str | None = None) -> None:
        """Set the reward of ``completion_id`` (every choice), default the last completion.
        ``KeyError`` for an unknown id, ``LookupError`` when there is no turn yet."""
        if not self.turns:
            raise LookupError("no completion to reward yet: the agent has not called the model")
        target = self.turns[-1].completion_id if completion_id is None else completion_id
        turns = [t for t in self.turns if t.completion_id == target]
        if not turns:
            raise KeyError(f"no completion {target!r} in this episode (known: {self.completion_ids()[-5:]})")
        for turn in turns:
            turn.reward = float(reward)

    def export(self, turn_discount: float = 1.0) -> dict[str, Tensor]:
        """The episode's rows (see the module docstring); ``ValueError`` without any turn."""
        if not self.turns:
            raise ValueError("the episode has no turns to export")
        scored = any(t.reward is not None for t in self.turns)
        rows = [_row(leaf, turn_discount, scored) for leaf in self.turns if leaf.children == 0]
        return concat_padded_tensors(rows)


def _row(leaf: Turn, turn_discount: float, scored: bool) -> dict[str, Tensor]:
    builder = TrajectoryBuilder()
    chain = leaf.chain()
    for turn in chain:
        resp = turn.response
        builder.add_prompt(turn.new_prompt)
        builder.add_output(resp.output_tokens, resp.output_logprobs, resp.output_versions)
    reward = sum(turn_discount**i * (t.reward or 0.0) for i, t in enumerate(chain)) if scored else None
    row = builder.to_tensors(reward=reward, is_truncated=leaf.response.stop_reason == "length")
    if row["input_ids"][0].tolist() != leaf.full_ids:  # the chain is built from these very tokens
        raise RuntimeError(f"turn {leaf.completion_id}: exported tokens differ from the engine's prompt + output")
    return row

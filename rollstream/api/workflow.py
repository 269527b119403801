"""The rollout programming model: a workflow, and what one episode returns.

A workflow turns one data item into training data by calling an :class:`InferenceEngine`.
Its result is one of:

- a tensor dict of ``[B, L]`` sequence tensors (see :mod:`rollstream.trajectory.rows`);
- a ``dict[str, Interaction]`` of recorded engine calls (agent style), turned into tensors by
  :func:`rollstream.trajectory.normalize.interactions_to_tensors`;
- ``None``: the episode is rejected (e.g. filtered out on purpose); nothing is trained on it and
  it is counted as a rejection. A workflow that *fails* raises instead; failures and rejections
  are counted apart.

What is configured as a workflow becomes one by :func:`rollstream.workflows.resolve.resolve_workflow`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Union

from torch import Tensor

from rollstream.api.engine import InferenceEngine
from rollstream.api.io_struct import ModelRequest, ModelResponse


@dataclass
class Interaction:
    """One engine call of an episode and the reward given to it (``None``: not scored)."""

    request: ModelRequest
    response: ModelResponse
    reward: float | None = None


EpisodeResult = Union[dict[str, Tensor], dict[str, Interaction], None]


class RolloutWorkflow(abc.ABC):
    """User code that runs one episode. Instances may run many episodes concurrently."""

    @abc.abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> EpisodeResult:
        """Run one episode on ``data``.

        Returns a ``[B, L]`` tensor dict (at least ``input_ids`` and ``attention_mask``), a
        dict of :class:`Interaction` keyed by an id, or ``None`` to reject the episode (it is
        not trained on and counts as a rejection, not a failure). Raise to report a failure.
        """


def is_interactions(result: object) -> bool:
    """True for a non-empty dict whose values are all :class:`Interaction`."""
    return isinstance(result, dict) and bool(result) and all(isinstance(v, Interaction) for v in result.values())

"""The rollout programming model: workflows, interactions, grouping and workflow resolution.

A workflow turns one data item into training data by calling an :class:`InferenceEngine`.
Its result is one of:

- a tensor dict of ``[B, L]`` sequence tensors (see :mod:`rollstream.trajectory.rows`);
- a ``dict[str, Interaction]`` of recorded engine calls (agent style), turned into tensors by
  :func:`interactions_to_tensors`;
- ``None``: the episode is rejected (e.g. filtered out on purpose); nothing is trained on it and
  it is counted as a rejection. A workflow that *fails* raises instead; failures and rejections
  are counted apart.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Union

from torch import Tensor

from rollstream.api.context import workflow_context
from rollstream.imports import import_object
from rollstream.api.engine import InferenceEngine
from rollstream.api.io_struct import ModelRequest, ModelResponse
from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.trajectory.rows import trajectory_row

logger = logging.getLogger(__name__)


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


def interactions_to_tensors(interactions: dict[str, Interaction]) -> dict[str, Tensor]:
    """One row per interaction (in dict order), right-padded with :func:`concat_padded_tensors`.

    Row: ``input_ids`` = input + output tokens; ``loss_mask`` 1 on output; ``logprobs`` 0.0 and
    ``versions`` -1 on the input; ``attention_mask`` ones; ``rewards`` the interaction's reward
    (0.0 when ``None``); ``is_truncated`` when the stop reason was "length".
    """
    rows = []
    for inter in interactions.values():
        resp = inter.response
        prompt = resp.input_tokens or inter.request.input_ids
        rows.append(
            trajectory_row(
                prompt, resp.output_tokens, resp.output_logprobs, resp.output_versions,
                reward=0.0 if inter.reward is None else inter.reward,
                is_truncated=resp.stop_reason == "length",
            )
        )
    return concat_padded_tensors(rows)


def merge_results(results: list[EpisodeResult]) -> EpisodeResult:
    """Combine episode results: ``None`` dropped (all ``None`` -> ``None``); interaction dicts
    merged (an id already taken by an earlier member gets ``@<member index>`` appended, so no
    interaction is lost); tensor dicts concatenated. Mixing the two kinds raises ``TypeError``."""
    kept = [(i, r) for i, r in enumerate(results) if r is not None]
    if not kept:
        return None
    kinds = {is_interactions(r) for _, r in kept}
    if len(kinds) > 1:
        raise TypeError("cannot merge tensor dicts with interaction dicts from the same group")
    if kinds == {True}:
        merged: dict[str, Interaction] = {}
        for i, r in kept:
            for key, inter in r.items():  # type: ignore[union-attr]
                merged[f"{key}@{i}" if key in merged else key] = inter
        return merged
    return concat_padded_tensors([r for _, r in kept])  # type: ignore[misc]


class GroupedRolloutWorkflow(RolloutWorkflow):
    """Runs ``group_size`` episodes of ``workflow`` concurrently on the same data.

    Member ``i`` runs in its own task with ``workflow_context.sample_idx`` set to
    ``outer_sample_idx * group_size + i`` (so an outer index of 0 gives 0..group_size-1). If a
    member raises, the others are cancelled and the error is re-raised.
    """

    def __init__(self, workflow: RolloutWorkflow, group_size: int) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.workflow = workflow
        self.group_size = group_size

    async def _member(self, engine: InferenceEngine, data: dict[str, Any], i: int) -> EpisodeResult:
        with workflow_context.scope(sample_idx=workflow_context.sample_idx * self.group_size + i):
            return await self.workflow.arun_episode(engine, data)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> EpisodeResult:
        tasks = [asyncio.create_task(self._member(engine, data, i)) for i in range(self.group_size)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return merge_results(list(results))


def _import_string(path: str) -> Any:
    """Import a workflow named by ``pkg.module.Name`` or ``pkg.module:Name``."""
    return import_object(path)


def _has_async_run(obj: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(obj, "run", None))


def _resolve_object(workflow: Any, workflow_kwargs: dict[str, Any] | None, label: str) -> RolloutWorkflow:
    if isinstance(workflow, RolloutWorkflow):
        if workflow_kwargs:
            logger.warning("workflow %r is an instance; ignoring workflow_kwargs %s", workflow, sorted(workflow_kwargs))
        return workflow
    if isinstance(workflow, type) and issubclass(workflow, RolloutWorkflow):
        if workflow_kwargs is None:
            raise ValueError(f"workflow class {workflow.__qualname__} needs workflow_kwargs to be constructed")
        return workflow(**workflow_kwargs)
    from rollstream.api.areal_adapter import ArealWorkflow, is_areal_workflow  # builds on this module

    if is_areal_workflow(workflow):
        return ArealWorkflow(_resolve_areal(workflow, workflow_kwargs))
    if _has_async_run(workflow):
        from rollstream.agent.workflow import AgentWorkflow  # the agent runtime builds on this module

        if isinstance(workflow, type):
            return AgentWorkflow(workflow(**(workflow_kwargs or {})))
        if workflow_kwargs:
            logger.warning("agent %r is an instance; ignoring workflow_kwargs %s", workflow, sorted(workflow_kwargs))
        return AgentWorkflow(workflow)
    raise TypeError(
        f"cannot use {label} as a workflow: expected a RolloutWorkflow instance or subclass (rollstream's "
        "or AReaL's), an import string naming one, or an agent (object or class) with 'async def run(data, **extra)'"
    )


def _resolve_areal(workflow: Any, workflow_kwargs: dict[str, Any] | None) -> Any:
    """An instance of AReaL's workflow class, by the same rules as rollstream's own."""
    if not isinstance(workflow, type):
        if workflow_kwargs:
            logger.warning("workflow %r is an instance; ignoring workflow_kwargs %s", workflow, sorted(workflow_kwargs))
        return workflow
    if workflow_kwargs is None:
        raise ValueError(f"workflow class {workflow.__qualname__} needs workflow_kwargs to be constructed")
    return workflow(**workflow_kwargs)


def resolve_workflow(
    workflow: Any, workflow_kwargs: dict[str, Any] | None = None, group_size: int = 1
) -> RolloutWorkflow:
    """Turn what a user configured into a runnable workflow (AReaL's resolution table).

    - a :class:`RolloutWorkflow` instance: used as is (``workflow_kwargs`` ignored, with a warning);
    - a :class:`RolloutWorkflow` subclass: ``cls(**workflow_kwargs)``; ``None`` kwargs -> ``ValueError``;
    - an instance or subclass of AReaL's ``RolloutWorkflow`` (``areal`` installed): the same, run
      by :class:`rollstream.api.areal_adapter.ArealWorkflow` as AReaL runs it;
    - a string ``"pkg.module.Name"`` or ``"pkg.module:Name"``: imported, then these same rules
      (``ImportError`` / ``ValueError`` naming the string when that fails);
    - any other object or class with ``async def run``: a
      :class:`rollstream.agent.workflow.AgentWorkflow`, which runs it against the OpenAI-compatible
      agent endpoint (a class is instantiated with ``workflow_kwargs``, or without arguments when
      they are ``None``);
    - anything else: ``TypeError``.

    With ``group_size > 1`` the result is wrapped in :class:`GroupedRolloutWorkflow`.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if isinstance(workflow, str):
        target = _import_string(workflow)
        label = f"{workflow!r} (imported {target!r})"
    else:
        target, label = workflow, repr(workflow)
    resolved = _resolve_object(target, workflow_kwargs, label)
    return GroupedRolloutWorkflow(resolved, group_size) if group_size > 1 else resolved

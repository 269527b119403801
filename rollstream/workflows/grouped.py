"""A group of episodes run as one: ``group_size`` members of one workflow on the same data."""

from __future__ import annotations

import asyncio
from typing import Any

from rollstream.api.context import workflow_context
from rollstream.api.engine import InferenceEngine
from rollstream.api.workflow import EpisodeResult, Interaction, RolloutWorkflow, is_interactions
from rollstream.trajectory.padding import concat_padded_tensors


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

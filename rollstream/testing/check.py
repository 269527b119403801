"""Run a workflow N times the way a rollout worker runs it, and check what it returns.

:func:`check_workflow` is a workflow author's first test. It does what the rollout worker does
with one prompt of ``n`` samples, without Kafka: the ``data`` row goes through the prompt's
wire encoding (so the workflow sees what it will see in production), each sample runs in its
own task, its own ``workflow_context`` scope and its own recording view of the engine; each
result is normalized (``rollstream.trajectory.normalize``) and sent through the episode's wire encoding
and back. A sample ends as an episode (standard tensors, as the reward tier will read them),
a rejection (the workflow returned ``None``) or a failure (it raised, or its result cannot be
made standard), exactly as in a pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from rollstream.api.context import workflow_context
from rollstream.api.engine import InferenceEngine
from rollstream.api.io_struct import ModelResponse
from rollstream.engines.episode_engine import EpisodeEngine
from rollstream.trajectory.normalize import TrajectoryError, episode_tensors
from rollstream.rewards.wrapper import close_workflow
from rollstream.wire import Episode, PromptTask, decode_episode, decode_prompt, encode
from rollstream.wire.torch_tensors import decode_tensor_dict, encode_tensor_dict
from rollstream.workflows.resolve import resolve_workflow

Outcome = Literal["episode", "rejected", "failed"]


@dataclass
class SampleCheck:
    """One sample: its outcome, its tensors as the reward tier reads them (episodes only), why
    it failed (failures only), and the engine responses it received."""

    sample_idx: int
    outcome: Outcome
    tensors: dict[str, Tensor] | None = None
    error: str | None = None
    responses: list[ModelResponse] = field(default_factory=list)


@dataclass
class WorkflowCheck:
    """Every sample of one :func:`check_workflow` run, in sample order."""

    samples: list[SampleCheck]

    def _with(self, outcome: Outcome) -> list[SampleCheck]:
        return [s for s in self.samples if s.outcome == outcome]

    @property
    def episodes(self) -> list[SampleCheck]:
        return self._with("episode")

    @property
    def rejected(self) -> list[SampleCheck]:
        return self._with("rejected")

    @property
    def failed(self) -> list[SampleCheck]:
        return self._with("failed")


async def check_workflow(
    workflow: Any,
    data: dict[str, Any],
    *,
    n: int = 4,
    engine: InferenceEngine | None = None,
    workflow_kwargs: dict[str, Any] | None = None,
    is_eval: bool = False,
    allow_failures: bool = False,
) -> WorkflowCheck:
    """Run ``workflow`` ``n`` times on ``data`` (see the module docstring).

    ``workflow`` is anything ``rollout.workflows`` may name: an instance, a class (with
    ``workflow_kwargs``), an import string, or an agent with ``async def run``. ``engine``
    defaults to an ``HFEngine`` on the tiny offline model (``tiny_model_dir()``), started and
    closed here. Raises ``AssertionError`` listing every failed sample unless
    ``allow_failures``; a ``data`` row the prompts topic cannot carry raises ``TypeError``.
    """
    resolved = resolve_workflow(workflow, workflow_kwargs)
    task = decode_prompt(encode(PromptTask(task_id="check-0", group_size=n, data=data, is_eval=is_eval)))
    try:
        async with _engine_or_tiny(engine) as shared:
            samples = await asyncio.gather(*(_sample(resolved, shared, task, i) for i in range(n)))
    finally:
        if resolved is not workflow:  # built here: its reward pools are released here
            await close_workflow(resolved)
    check = WorkflowCheck(list(samples))
    if check.failed and not allow_failures:
        reasons = "\n".join(f"  sample {s.sample_idx}: {s.error}" for s in check.failed)
        raise AssertionError(f"{len(check.failed)} of {n} samples failed:\n{reasons}")
    return check


@contextlib.asynccontextmanager
async def _engine_or_tiny(engine: InferenceEngine | None) -> AsyncIterator[InferenceEngine]:
    if engine is not None:
        yield engine
        return
    from rollstream.engines.hf import HFEngine
    from rollstream.testing.tiny import tiny_model_dir

    tiny = HFEngine(str(tiny_model_dir()), seed=0)
    await tiny.start()
    try:
        yield tiny
    finally:
        await tiny.close()


async def _sample(workflow: Any, shared: InferenceEngine, task: PromptTask, sample_idx: int) -> SampleCheck:
    engine = EpisodeEngine(shared, training=not task.is_eval)
    data = decode_prompt(encode(task)).data  # each sample its own copy, as in the worker
    with workflow_context.scope(task_id=task.task_id, is_eval=task.is_eval, sample_idx=sample_idx):
        try:
            result = await workflow.arun_episode(engine, data)
        except Exception as exc:  # a failure, as the worker counts it
            return SampleCheck(sample_idx, "failed", error=f"{type(exc).__name__}: {exc}", responses=engine.responses)
    if result is None:
        return SampleCheck(sample_idx, "rejected", responses=engine.responses)
    try:
        tensors = episode_tensors(result, engine.responses)
        episode = Episode(
            task_id=task.task_id, sample_idx=sample_idx, group_size=task.group_size,
            trajectory=encode_tensor_dict(tensors), is_eval=task.is_eval, has_reward="rewards" in tensors,
        )
    except (TrajectoryError, TypeError, ValueError) as exc:
        return SampleCheck(sample_idx, "failed", error=str(exc), responses=engine.responses)
    decoded = decode_episode(encode(episode))
    assert isinstance(decoded, Episode)
    return SampleCheck(sample_idx, "episode", tensors=dict(decode_tensor_dict(decoded.trajectory)), responses=engine.responses)

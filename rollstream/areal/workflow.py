"""AReaL's own workflow classes, run by rollstream as AReaL runs them (``pip install areal``).

A subclass of ``areal.api.workflow_api.RolloutWorkflow`` (AReaL's ``RLVRWorkflow``,
``MultiTurnWorkflow``, ``VisionRLVRWorkflow``, or a user's) is wrapped in :class:`ArealWorkflow`
by ``resolve_workflow``, which gives each episode what AReaL's ``WorkflowExecutor`` gives it
before ``arun_episode``, and nothing of AReaL is changed:

* ``areal.infra.workflow_context``: ``WorkflowContext(is_eval=..., task_id=...)`` for the
  episode, so ``workflow_context.get().is_eval`` and ``stat_scope()`` ("rollout" /
  "eval-rollout") answer as in AReaL, and ``areal.utils.stats_tracker`` records land in the
  right scope. AReaL's task id is an int: rollstream's task id and sample index hashed to 56 bits
  (:func:`areal_task_id`), the same for the same sample in every worker.
* ``areal.utils.perf_tracer``: the task is registered and set for the episode, so
  ``@session_context`` / ``@trace_session`` record sessions and phases when the user configured
  AReaL's tracer (``perf_tracer.configure``); each session is finalized as AReaL's executor does
  it: "accepted" (a result), "rejected" (``None``, reason "returned_none") or "failed" (raised,
  reason "workflow_exception"). Without a configured tracer all of it does nothing, as in AReaL.
* ``data["images"]``: the pipeline carries images as encoded files (bytes); AReaL's workflows
  and datasets use ``PIL`` images, so the episode gets its images opened as PIL images.
* The engine is the episode's own rollstream engine, which takes AReaL's ``ModelRequest`` and
  ``GenerationHyperparameters`` and answers with every field of AReaL's ``ModelResponse``
  (``rollstream.engines.request_check``, ``rollstream.api.io_struct``).
* Process settings: importing AReaL replaces Python's logger hierarchy (``areal.utils.logging``)
  and installs uvloop's event-loop policy (``areal.api.cli_args``); both are put back when an
  AReaL workflow is wrapped and after each of its episodes
  (``rollstream.runtime.import_effects``). AReaL's own loggers keep AReaL's handlers.

Nothing here imports ``areal``: a class is AReaL's when ``areal.api.workflow_api`` is already
imported (it must be, for such a class to exist) and the class derives from its
``RolloutWorkflow``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import sys
from collections.abc import Iterator
from typing import Any

from rollstream.api.context import workflow_context
from rollstream.api.engine import InferenceEngine
from rollstream.api.workflow import EpisodeResult, RolloutWorkflow
from rollstream.runtime.import_effects import undo_import_effects

_AREAL_WORKFLOW_MODULE = "areal.api.workflow_api"
_TASK_ID_BYTES = 7  # 56 bits: a positive int in every integer type AReaL's tracer writes


def areal_workflow_class() -> type | None:
    """AReaL's ``RolloutWorkflow`` when ``areal`` is imported, else ``None`` (never imports it)."""
    module = sys.modules.get(_AREAL_WORKFLOW_MODULE)
    return getattr(module, "RolloutWorkflow", None) if module is not None else None


def is_areal_workflow(obj: Any) -> bool:
    """True for an instance or subclass of AReaL's ``RolloutWorkflow``."""
    base = areal_workflow_class()
    if base is None:
        return False
    return isinstance(obj, base) or (isinstance(obj, type) and issubclass(obj, base))


def areal_task_id(task_id: str, sample_idx: int) -> int:
    """The int AReaL's context and tracer know an episode by (see the module doc)."""
    digest = hashlib.blake2b(f"{task_id}\0{sample_idx}".encode(), digest_size=_TASK_ID_BYTES).digest()
    return int.from_bytes(digest, "big")


class ArealWorkflow(RolloutWorkflow):
    """Runs one AReaL workflow instance in rollstream (see the module doc). ``workflow`` is
    the AReaL instance, shared by every episode like any workflow."""

    def __init__(self, workflow: Any) -> None:
        if not is_areal_workflow(workflow) or isinstance(workflow, type):
            raise TypeError(f"ArealWorkflow wraps an instance of AReaL's RolloutWorkflow, not {workflow!r}")
        self.workflow = workflow
        undo_import_effects()  # importing AReaL replaced the logger hierarchy

    def __repr__(self) -> str:
        return f"ArealWorkflow({self.workflow!r})"

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> EpisodeResult:
        with areal_episode() as finish:
            try:
                result = await self.workflow.arun_episode(engine, _with_pil_images(data))
            except BaseException:
                finish("failed", "workflow_exception")
                raise
            finally:
                undo_import_effects()  # AReaL code may have imported more of AReaL
            if result is None:
                finish("rejected", "returned_none")
            else:
                finish("accepted", None)
            return result

    async def aclose(self) -> None:
        """Release what the AReaL workflow holds that rollstream knows how to release."""
        from rollstream.rewards.wrapper import close_workflow  # the reward pool; imported only when closing

        await close_workflow(self.workflow)


@contextlib.contextmanager
def areal_episode() -> Iterator[Any]:
    """AReaL's workflow context and tracer task set for the current rollstream episode; yields
    ``finish(status, reason)``, which finalizes the episode's tracer sessions. Restores the
    previous values on exit."""
    areal_context = importlib.import_module("areal.infra.workflow_context")
    tracer = importlib.import_module("areal.utils.perf_tracer")
    ours = workflow_context.get()
    task = areal_task_id(ours.task_id, ours.sample_idx)
    outer_context, outer_task = areal_context.get(), tracer.get_task_id()
    tracer.register_task(task)
    tracer.set_task_id(task)
    areal_context.set(areal_context.WorkflowContext(is_eval=ours.is_eval, task_id=task))

    def finish(status: str, reason: str | None) -> None:
        payload = {"status": status} if reason is None else {"status": status, "reason": reason}
        tracer.trace_session_event("mark_finalized", task_id=task, **payload)

    try:
        yield finish
    finally:
        areal_context.set(outer_context)
        tracer.set_task_id(outer_task)


def _with_pil_images(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``images`` as PIL images (a copy; ``data`` itself is left as it is)."""
    from rollstream.vision.images import IMAGES_KEY, image_bytes, image_list, open_image

    images = data.get(IMAGES_KEY)
    if images is None:
        return data
    items = image_list(images)
    if all(_is_pil(item) for item in items):
        return data
    opened = [item if _is_pil(item) else open_image(image_bytes(item, f"images[{i}]")) for i, item in enumerate(items)]
    return {**data, IMAGES_KEY: opened}


def _is_pil(image: Any) -> bool:
    module = sys.modules.get("PIL.Image")
    return module is not None and isinstance(image, module.Image)

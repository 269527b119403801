"""What a user configured as a workflow, made into a runnable :class:`RolloutWorkflow`
(AReaL's resolution table: :func:`resolve_workflow`)."""

from __future__ import annotations

import inspect
import logging
from typing import Any

from rollstream.agent.workflow import AgentWorkflow
from rollstream.api.workflow import RolloutWorkflow
from rollstream.areal.workflow import ArealWorkflow, is_areal_workflow
from rollstream.imports import import_object
from rollstream.workflows.grouped import GroupedRolloutWorkflow

logger = logging.getLogger(__name__)


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
    if is_areal_workflow(workflow):
        return ArealWorkflow(_resolve_areal(workflow, workflow_kwargs))
    if _has_async_run(workflow):
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
      by :class:`rollstream.areal.workflow.ArealWorkflow` as AReaL runs it;
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
        target = import_object(workflow)
        label = f"{workflow!r} (imported {target!r})"
    else:
        target, label = workflow, repr(workflow)
    resolved = _resolve_object(target, workflow_kwargs, label)
    return GroupedRolloutWorkflow(resolved, group_size) if group_size > 1 else resolved

"""Per-episode values that workflow code can read without threading them through calls.

Built on :mod:`contextvars`, so each asyncio task sees the episode it runs: a task copies the
context it was created in, and a value set inside one task never leaks into another. Concurrently
running episodes are therefore isolated as long as each runs in its own task (as the rollout
worker and :class:`~rollstream.workflows.grouped.GroupedRolloutWorkflow` do).

Reading outside any episode returns defaults (``is_eval`` False, ``task_id`` "",
``sample_idx`` 0, ``stat_scope()`` "rollout") rather than raising: library code such as stats
recording and reward functions must also work in plain scripts and unit tests. Use
``workflow_context.in_episode()`` when the difference matters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, TypeVar

T = TypeVar("T")
StatScope = Literal["rollout", "eval-rollout"]


@dataclass(frozen=True)
class EpisodeContext:
    """What one episode knows about itself: its prompt's task id, its sample index, eval or not."""

    task_id: str = ""
    is_eval: bool = False
    sample_idx: int = 0

    @property
    def stat_scope(self) -> StatScope:
        return "eval-rollout" if self.is_eval else "rollout"


_DEFAULT = EpisodeContext()
_current: ContextVar[EpisodeContext | None] = ContextVar("rollstream_episode", default=None)


class WorkflowContext:
    """Accessors for the current episode; use the module-level ``workflow_context``."""

    def get(self) -> EpisodeContext:
        """The current episode's values, or the defaults outside any episode."""
        return _current.get() or _DEFAULT

    def in_episode(self) -> bool:
        """True inside :meth:`scope` (or :meth:`run_in_context`)."""
        return _current.get() is not None

    @property
    def task_id(self) -> str:
        return self.get().task_id

    @property
    def is_eval(self) -> bool:
        return self.get().is_eval

    @property
    def sample_idx(self) -> int:
        return self.get().sample_idx

    def stat_scope(self) -> StatScope:
        """"eval-rollout" for evaluation episodes, else "rollout" (also outside any episode)."""
        return self.get().stat_scope

    @contextlib.contextmanager
    def scope(
        self,
        task_id: str | None = None,
        is_eval: bool | None = None,
        sample_idx: int | None = None,
    ) -> Iterator[EpisodeContext]:
        """Set the episode values for the enclosed code; restored on exit, also on error.

        Arguments left as ``None`` keep the enclosing episode's value (or the default), so
        scopes nest: an inner ``scope(sample_idx=3)`` keeps the outer task id.
        """
        outer = self.get()
        ctx = EpisodeContext(
            task_id=outer.task_id if task_id is None else str(task_id),
            is_eval=outer.is_eval if is_eval is None else bool(is_eval),
            sample_idx=outer.sample_idx if sample_idx is None else int(sample_idx),
        )
        token = _current.set(ctx)
        try:
            yield ctx
        finally:
            _current.reset(token)

    async def run_in_context(
        self,
        awaitable: Awaitable[T],
        *,
        task_id: str | None = None,
        is_eval: bool | None = None,
        sample_idx: int | None = None,
    ) -> T:
        """Await ``awaitable`` with the given episode values set, and return its result."""
        with self.scope(task_id=task_id, is_eval=is_eval, sample_idx=sample_idx):
            return await awaitable


workflow_context = WorkflowContext()

"""Agent workflows: any object with ``async def run(data, **extra)``, run against the endpoint.

:class:`AgentWorkflow` is what ``resolve_workflow`` makes of an agent. For each episode it
opens a session on an :class:`~rollstream.agent.endpoint.AgentEndpoint` (the worker's, or a
private one on 127.0.0.1 when none is given) and calls::

    await agent.run(data, base_url=..., api_key=..., http_client=..., session=..., engine=...)

``base_url`` / ``api_key`` are the session's (pass them to ``openai.AsyncOpenAI``);
``http_client`` is an ``openai.DefaultAsyncHttpxClient`` that ignores proxy variables (the
endpoint is local) and is closed after the episode; ``session`` sets rewards during the
episode; ``engine`` is the episode's engine for agents that generate from token ids
themselves. Callers may rely on:

* The episode's rows are the session's conversation (``rollstream.agent.conversation``):
  one row per conversation the agent had, with exactly the engine's tokens, logprobs and
  versions, ``loss_mask`` 1 only on generated tokens.
* ``run`` returning a number sets the reward of the last completion; a dict sets rewards by
  completion id (an id the episode did not produce raises ``KeyError``); ``None`` keeps the
  rewards set during the episode. Anything else raises ``TypeError``. Rows are discounted by
  ``turn_discount`` per model turn before the last one.
* The episode fails (the worker publishes a failed sample with the reason) when the agent
  raises (the reason also quotes the endpoint's last error answer, if any), runs longer than
  ``timeout_seconds`` (it is cancelled), or returns without any model call.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any

from torch import Tensor

from rollstream.agent.endpoint import AgentEndpoint
from rollstream.agent.session import AgentSession
from rollstream.api.engine import InferenceEngine
from rollstream.api.workflow import RolloutWorkflow
from rollstream.config import AgentConfig
from rollstream.runtime.stats import stats_tracker

log = logging.getLogger(__name__)

CANCEL_GRACE_SECONDS = 5.0  # how long a timed-out agent may take to honour its cancellation


class AgentError(RuntimeError):
    """An agent episode that cannot become training data; the message says why."""


class AgentWorkflow(RolloutWorkflow):
    """See the module docstring. ``endpoint=None``: each episode starts a private endpoint with
    ``tokenizer`` (default: the engine's ``tokenizer`` attribute)."""

    def __init__(
        self, agent: Any, *, endpoint: AgentEndpoint | None = None, tokenizer: Any = None,
        timeout_seconds: float | None = AgentConfig().timeout_seconds, turn_discount: float = 1.0,
    ) -> None:
        if not inspect.iscoroutinefunction(getattr(agent, "run", None)):
            raise TypeError(f"{agent!r} has no 'async def run(data, **extra)'")
        if not 0.0 < turn_discount <= 1.0:
            raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount}")
        self.agent = agent
        self.endpoint = endpoint
        self.tokenizer = tokenizer
        self.timeout_seconds = timeout_seconds
        self.turn_discount = turn_discount
        self._abandoned: set[asyncio.Task[Any]] = set()  # agents that ignored their cancellation

    def served_by(self, endpoint: AgentEndpoint, config: AgentConfig) -> AgentWorkflow:
        """The same agent on ``endpoint`` with ``config``'s timeout and discount (the worker's)."""
        return AgentWorkflow(self.agent, endpoint=endpoint, timeout_seconds=config.timeout_seconds,
                             turn_discount=config.turn_discount)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, Tensor]:
        async with self._endpoint_for(engine) as endpoint:
            session = endpoint.open_session(engine)
            http_client = _http_client()
            try:
                result = await self._run(session, data, http_client)
                return self._rows(session, result)
            finally:
                await endpoint.close_session(session)
                if http_client is not None:
                    await http_client.aclose()

    @contextlib.asynccontextmanager
    async def _endpoint_for(self, engine: InferenceEngine) -> AsyncIterator[AgentEndpoint]:
        if self.endpoint is not None:
            await self.endpoint.start()
            yield self.endpoint
            return
        private = AgentEndpoint(AgentConfig(), self.tokenizer or getattr(engine, "tokenizer", None))
        await private.start()
        try:
            yield private
        finally:
            await private.close()

    async def _run(self, session: AgentSession, data: dict[str, Any], http_client: Any) -> Any:
        """``agent.run``'s result; its exception (with the endpoint's last error), or
        :class:`AgentError` when it outlived ``timeout_seconds``."""
        task = asyncio.ensure_future(self.agent.run(
            data, base_url=session.base_url, api_key=session.api_key, http_client=http_client,
            session=session, engine=session.engine,
        ))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout_seconds)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            await self._cancel(task)
            raise AgentError(
                f"agent did not finish within {self.timeout_seconds:g}s (rollout.agent.timeout_seconds); "
                f"it made {len(session.completion_ids)} model calls"
            )
        exc = task.exception()
        if exc is not None and session.errors:
            raise AgentError(
                f"agent raised {type(exc).__name__}: {exc}; the endpoint had answered {session.errors[-1]}"
            ) from exc
        return task.result()

    async def _cancel(self, task: asyncio.Task[Any]) -> None:
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_GRACE_SECONDS)
        if not task.done():  # it swallows CancelledError: keep a reference, never await it again
            log.error("an agent ignored its cancellation for %.0fs; abandoning it", CANCEL_GRACE_SECONDS)
            self._abandoned.add(task)
            task.add_done_callback(self._abandoned.discard)

    def _rows(self, session: AgentSession, result: Any) -> dict[str, Tensor]:
        conversation = session.conversation
        if not conversation.turns:
            raise AgentError(
                "agent returned without calling the model: nothing to train on (it must call "
                "chat.completions on base_url, or engine.agenerate)"
            )
        _apply_result(session, result)
        stats_tracker.record(agent_turns=len(conversation.turns))
        return conversation.export(self.turn_discount)


def _apply_result(session: AgentSession, result: Any) -> None:
    if result is None:
        return
    if isinstance(result, dict):
        known = set(session.completion_ids)
        unknown = sorted(str(k) for k in result if k not in known)
        if unknown:
            raise KeyError(f"agent returned rewards for completion ids this episode did not produce: {unknown[:5]}")
        for completion_id, reward in result.items():
            session.set_reward(float(reward), completion_id)
    elif isinstance(result, (int, float)):  # a bool too: answer == expected
        session.set_reward(float(result))
    else:
        raise TypeError(f"agent run() must return a float, a dict of completion id -> reward, or None; "
                        f"got {type(result).__name__}")


def _http_client() -> Any:
    """A client for the local endpoint of the ``openai`` package's own kind (httpx or httpx2)."""
    try:
        import openai
    except ImportError:
        return None
    return openai.DefaultAsyncHttpxClient(trust_env=False)

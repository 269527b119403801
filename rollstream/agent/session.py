"""One agent episode's session on the endpoint: its address and key, its turns, its rewards.

An :class:`AgentSession` is what an agent receives as ``session`` (beside ``base_url``,
``api_key`` and ``http_client``). Callers may rely on:

* ``base_url`` and ``api_key`` work for this episode only, on this endpoint only; once the
  episode ended (:meth:`AgentSession.close`) the key is refused like any unknown key.
* :meth:`AgentSession.set_reward` sets the reward of a completion (default: the last one)
  while the episode runs; ``POST {base_url}/rewards`` does the same over HTTP.
* ``session.engine`` is the episode's engine for agents that call ``agenerate`` themselves:
  each call is recorded as a turn of its own (one row), keyed by the request's ``rid``.
* Closing cancels the requests still generating for the session: nothing is recorded after.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from rollstream.agent.chat_template import ChatRenderer
from rollstream.agent.conversation import Conversation, Turn
from rollstream.api.engine import DelegatingEngine, InferenceEngine
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.runtime.tasks import cancel_and_wait

T = TypeVar("T")


class SessionClosed(Exception):
    """The session's episode ended while a request was being answered."""


@dataclass(frozen=True)
class SessionSettings:
    """What every session of an endpoint shares."""

    renderer: ChatRenderer | None  # None: the tokenizer has no chat template (``no_chat_reason``)
    defaults: GenerationHyperparameters  # the worker's generation settings; requests override them
    model_name: str
    no_chat_reason: str = ""


class AgentSession:
    """See the module docstring."""

    def __init__(
        self, session_id: str, api_key: str, base_url: str, engine: InferenceEngine, settings: SessionSettings,
    ) -> None:
        self.session_id = session_id
        self.api_key = api_key
        self.base_url = base_url
        self.settings = settings
        self.conversation = Conversation()
        self.engine: InferenceEngine = _RecordingEngine(engine, self)
        self.generator = engine  # chat completions generate through the episode's engine view
        self.closed = False
        self.errors: list[str] = []  # the endpoint's error answers, newest last (for failure reasons)
        self._inflight: set[asyncio.Task[Any]] = set()

    def set_reward(self, reward: float, completion_id: str | None = None) -> None:
        """The reward of ``completion_id`` (every choice of it), default the last completion.
        ``KeyError`` for an id this episode did not produce; ``LookupError`` before any call."""
        self.conversation.set_reward(float(reward), completion_id)

    @property
    def completion_ids(self) -> list[str]:
        """The ids of the episode's completions (and direct engine calls), oldest first."""
        return self.conversation.completion_ids()

    def record(self, turns: list[Turn]) -> None:
        """Add the turns of one answered request (refused once the session closed)."""
        if self.closed:
            raise SessionClosed(f"session {self.session_id} ended")
        for turn in turns:
            self.conversation.add(turn)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` as a task that :meth:`close` cancels; ``SessionClosed`` if it did."""
        if self.closed:
            coro.close()
            raise SessionClosed(f"session {self.session_id} ended")
        task = asyncio.ensure_future(coro)
        self._inflight.add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if self.closed and task.cancelled():
                raise SessionClosed(f"session {self.session_id} ended while the request was generating") from None
            task.cancel()  # our caller was cancelled: stop the work it asked for
            raise
        finally:
            self._inflight.discard(task)

    async def close(self) -> None:
        """End the session: cancel what is still generating and wait for it to stop."""
        self.closed = True
        await cancel_and_wait(*self._inflight)


class _RecordingEngine(DelegatingEngine):
    """The episode's engine; every ``agenerate`` also becomes a turn of the session."""

    def __init__(self, inner: InferenceEngine, session: AgentSession) -> None:
        super().__init__(inner)
        self.session = session

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        resp = await self.session.run(self.inner.agenerate(req))
        taken = set(self.session.completion_ids)
        key, n = req.rid, 1
        while key in taken:  # a reused rid must not merge two calls
            key, n = f"{req.rid}#{n}", n + 1
        self.session.record([Turn(completion_id=key, choice=0, new_prompt=list(resp.input_tokens), response=resp)])
        return resp

"""The OpenAI-compatible HTTP endpoint agent workflows talk to, served beside the engine.

One :class:`AgentEndpoint` per rollout worker (``rollout.agent.*``) serves every agent
episode of that worker. Each episode opens a session (:meth:`AgentEndpoint.open_session`)
and gets its own ``base_url`` (``http://<host>:<port>/sessions/<id>/v1``) and ``api_key``.
Routes under a session's ``base_url``, all requiring ``Authorization: Bearer <api_key>``:

* ``POST /chat/completions``: ``rollstream.agent.completions`` (non-streaming, or server-sent
  events with ``"stream": true``: the role, the content (with its logprobs), the tool calls and
  the finish reason of each choice once it is generated, then ``usage`` when asked, then
  ``[DONE]``);
* ``GET /models``: the one model this worker serves;
* ``POST /rewards``: ``{"reward": r, "completion_id": id?}`` sets a completion's reward.

Errors are OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for a
request that cannot be served (the message says why), 401 for a key that is not this
session's (also after the episode ended), 404 for an unknown completion id, 410 when the
episode ended while the request was generating, 500 for an engine failure. The endpoint binds
to ``rollout.agent.host`` (127.0.0.1 by default).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from rollstream.agent.chat_template import ChatRenderer
from rollstream.agent.completions import create_completion
from rollstream.agent.messages import RequestError
from rollstream.agent.openai_types import (
    ChatCompletion, ChatCompletionChunk, ChunkChoice, Delta, ErrorBody, ErrorDetail, ModelCard, ModelList,
    ToolCallDelta, Usage, decode_request, decode_reward,
)
from rollstream.agent.session import AgentSession, SessionClosed, SessionSettings
from rollstream.api.engine import InferenceEngine
from rollstream.api.io_struct import GenerationHyperparameters
from rollstream.config import AgentConfig

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024  # long conversations with tool outputs
_encoder = msgspec.json.Encoder()
_WILDCARDS = ("", "0.0.0.0", "::")


class AgentEndpoint:
    """See the module docstring. ``start`` is idempotent; ``close`` ends every session."""

    def __init__(
        self, config: AgentConfig, tokenizer: Any, defaults: GenerationHyperparameters | None = None,
        model_name: str = "rollstream",
    ) -> None:
        self.config = config
        renderer: ChatRenderer | None = None
        reason = "the agent endpoint has no tokenizer: give it the model's tokenizer (rollout.tokenizer_path)"
        if tokenizer is not None:
            try:
                renderer, reason = ChatRenderer(tokenizer), ""
            except RequestError as exc:
                reason = str(exc)
        if defaults is None:
            defaults = GenerationHyperparameters()
            if tokenizer is not None:
                defaults = defaults.new_with_stop_and_pad_token_ids(tokenizer)
        self.settings = SessionSettings(renderer, defaults, config.model_name or model_name, reason)
        self._sessions: dict[str, AgentSession] = {}
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._lock = asyncio.Lock()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the agent endpoint is not started")
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port`` as sessions' base URLs name it."""
        host = self.config.public_host or self.config.host
        if host in _WILDCARDS:
            host = socket.gethostname()
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    async def start(self) -> None:
        async with self._lock:
            if self._runner is not None:
                return
            app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_answer_errors])
            app.add_routes([
                web.post("/sessions/{session}/v1/chat/completions", self._chat),
                web.get("/sessions/{session}/v1/models", self._models),
                web.post("/sessions/{session}/v1/rewards", self._reward),
            ])
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, self.config.host, self.config.port)
            try:
                await site.start()
            except OSError as exc:
                await runner.cleanup()
                raise OSError(
                    f"the agent endpoint cannot listen on {self.config.host}:{self.config.port} "
                    f"(rollout.agent.host/port): {exc}"
                ) from exc
            self._runner = runner
            self._port = int(runner.addresses[0][1])
            log.info("agent endpoint listening on %s (model %s)", self.url, self.settings.model_name)

    async def close(self) -> None:
        for session in list(self._sessions.values()):
            await self.close_session(session)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self._port = None, None

    def open_session(self, engine: InferenceEngine) -> AgentSession:
        """A new session generating with ``engine`` (the episode's engine view)."""
        session_id = secrets.token_hex(8)
        session = AgentSession(
            session_id, secrets.token_urlsafe(32), f"{self.url}/sessions/{session_id}/v1", engine, self.settings,
        )
        self._sessions[session_id] = session
        return session

    async def close_session(self, session: AgentSession) -> None:
        """End ``session``: its key is refused from now on, its requests are cancelled."""
        self._sessions.pop(session.session_id, None)
        await session.close()

    def __len__(self) -> int:
        """Open sessions."""
        return len(self._sessions)

    # ---------------------------------------------------------------- handlers

    def _session(self, request: web.Request) -> AgentSession:
        header = request.headers.get("Authorization", "")
        key = header[len("Bearer "):] if header.startswith("Bearer ") else ""
        session = self._sessions.get(request.match_info["session"])
        # Unknown session and wrong key look the same: a key reveals nothing about other sessions.
        if session is None or not hmac.compare_digest(session.api_key.encode(), key.encode()):
            raise _error(401, "this api key is not valid for this session (a session ends with its episode)",
                         "authentication_error", code="invalid_api_key")
        return session

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        return _json(ModelList(data=[ModelCard(id=self.settings.model_name)]))

    async def _reward(self, request: web.Request) -> web.Response:
        session = self._session(request)
        try:
            reward = decode_reward(await request.read())
            session.set_reward(reward.reward, reward.completion_id)
        except RequestError as exc:
            raise _error(400, str(exc), param=exc.param) from None
        except LookupError as exc:  # KeyError too: an id this episode did not produce
            raise _error(404, str(exc).strip("'\""), param="completion_id") from None
        return _json({"ok": True})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        try:
            body = decode_request(await request.read())
            completion = await create_completion(session, body)
        except RequestError as exc:
            raise _failure(session, 400, str(exc), param=exc.param) from None
        except SessionClosed as exc:
            raise _error(410, str(exc), code="session_ended") from None
        except ValueError as exc:  # the engine refused the request (too long, no budget left)
            raise _failure(session, 400, str(exc)) from None
        except Exception as exc:
            log.exception("agent endpoint: session %s: request failed", session.session_id)
            raise _failure(session, 500, f"{type(exc).__name__}: {exc}", kind="server_error") from None
        if not body.stream:
            return _json(completion)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return await _stream(request, completion, include_usage)


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=_encoder.encode(value), status=status, content_type="application/json")


class _ErrorAnswer(Exception):
    """An OpenAI-style error answer, raised in a handler and sent by :func:`_answer_errors`."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


@web.middleware
async def _answer_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except _ErrorAnswer as answer:
        return web.Response(body=answer.body, status=answer.status, content_type="application/json")


def _error(status: int, message: str, kind: str = "invalid_request_error", *, param: str | None = None,
           code: str | None = None) -> _ErrorAnswer:
    return _ErrorAnswer(status, _encoder.encode(ErrorBody(ErrorDetail(message=message, type=kind, param=param, code=code))))


def _failure(session: AgentSession, status: int, message: str, kind: str = "invalid_request_error",
             param: str | None = None) -> _ErrorAnswer:
    """An error answer that the episode's failure reason will quote if the agent then fails."""
    session.errors.append(f"{status} {message}")
    return _error(status, message, kind, param=param)


async def _stream(request: web.Request, completion: ChatCompletion, include_usage: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    async for chunk in _chunks(completion, include_usage):
        await response.write(b"data: " + _encoder.encode(chunk) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _chunks(completion: ChatCompletion, include_usage: bool) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(choice: ChunkChoice | None, usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=completion.id, created=completion.created, model=completion.model,
                                   choices=[] if choice is None else [choice], usage=usage)

    for choice in completion.choices:
        message = choice.message
        yield chunk(ChunkChoice(index=choice.index, delta=Delta(role="assistant", content="")))
        if message.content:
            yield chunk(ChunkChoice(index=choice.index, delta=Delta(content=message.content), logprobs=choice.logprobs))
        if message.tool_calls:
            calls = [ToolCallDelta(index=i, id=c.id, function=c.function) for i, c in enumerate(message.tool_calls)]
            yield chunk(ChunkChoice(index=choice.index, delta=Delta(tool_calls=calls)))
        yield chunk(ChunkChoice(index=choice.index, delta=Delta(), finish_reason=choice.finish_reason))
    if include_usage:
        yield chunk(None, completion.usage)

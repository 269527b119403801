"""The HTTP layer shared by the server engines (SGLang, vLLM) and the weight-sync owners.

Callers may rely on:

* :class:`ServerHttp` posts and gets JSON with an explicit timeout per call. HTTP 5xx raises
  :class:`Retryable` (worth another try, maybe elsewhere); HTTP 4xx raises :class:`HttpRefused`
  (an :class:`EngineRequestError`) carrying the status and the server's message; a 2xx answer
  that is not JSON raises :class:`EngineRequestError`. Connection errors
  and timeouts propagate as ``aiohttp.ClientError`` / ``asyncio.TimeoutError``.
* :func:`parse_weight_version` turns a server's weight-version label into a rollstream
  version: the decimal string rollstream sets with each load, or ``"default"`` (the weights the
  server was started with; SGLang and vLLM both start with that label) as version 0; anything
  else is ``None`` (not a rollstream version, e.g. the label of a load in progress).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp

from rollstream.config import ServerConfig

INITIAL_WEIGHT_VERSION = "default"  # what SGLang and vLLM report before their first weight update
_DECIMAL = re.compile(r"-?\d+")
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


class EngineUnavailableError(RuntimeError):
    """No server could serve the call: all are down, behind, or retries ran out."""


class EngineRequestError(RuntimeError):
    """A server refused the request (HTTP 4xx or an error abort) or answered unusably."""


class HttpRefused(EngineRequestError):
    """HTTP 4xx: ``status`` and ``message`` (the server's own words, shortened)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"HTTP {status} from {url}: {message}")
        self.status = status
        self.message = message

    @property
    def duplicate_rid(self) -> bool:
        """The server still holds a request with this ``rid`` (SGLang notices dropped clients late)."""
        return self.status == 400 and "duplicate request id" in self.message.lower()


class Retryable(Exception):
    """An HTTP 5xx answer: worth another try, maybe on another server."""


def parse_weight_version(value: Any) -> int | None:
    """The rollstream version of a server's weight-version label; None when it is not one."""
    if value == INITIAL_WEIGHT_VERSION:
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _DECIMAL.fullmatch(value):
        return int(value)
    return None


def error_message(text: str) -> str:
    """The message of an error body (``{"error": {"message"}}``, ``{"message"}``, FastAPI's
    ``{"detail"}``, or ``{"error": "..."}``)."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"][:300]
        for key in ("message", "detail", "error"):
            if isinstance(body.get(key), str):
                return body[key][:300]
    return text[:300]


class ServerHttp:
    """One aiohttp session for every server; see the module docstring."""

    def __init__(self, settings: ServerConfig) -> None:
        self.settings = settings
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection cap: servers queue requests themselves; a client-side cap would hide load.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, connect=min(total, self.settings.connect_timeout_seconds))

    async def post(self, url: str, path: str, body: dict[str, Any], timeout: float) -> Any:
        """POST ``body`` as JSON; the decoded JSON answer (see the module docstring for errors)."""
        async with self._client().post(f"{url}{path}", json=body, timeout=self._timeout(timeout)) as resp:
            text = await resp.text()
            _raise_for_status(f"{url}{path}", resp.status, text)
            try:
                return json.loads(text) if text else None
            except ValueError:
                raise EngineRequestError(f"non-JSON answer from {url}{path}: {text[:200]!r}") from None

    async def get(self, url: str, path: str, timeout: float) -> tuple[int, Any]:
        """GET; ``(status, decoded JSON or None)``: no status is raised, callers decide."""
        async with self._client().get(f"{url}{path}", timeout=self._timeout(timeout)) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text) if text else None
            except ValueError:
                return resp.status, None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _raise_for_status(where: str, status: int, text: str) -> None:
    if status >= 500:
        raise Retryable(f"HTTP {status} from {where}: {error_message(text)}")
    if status >= 400:
        raise HttpRefused(where, status, error_message(text))

"""The HTTP layer shared by the server engines (SGLang, vLLM) and the sync owners.

Callers may rely on:

* :class:`ServerHttp` posts and gets JSON with an explicit timeout per call. HTTP 5xx raises
  :class:`Retryable` (worth another try, maybe elsewhere); HTTP 4xx raises :class:`HttpRefused`
  (an :class:`EngineRequestError`) carrying the status and the server's message; a 2xx answer
  that is not JSON raises :class:`EngineRequestError`. Connection errors
  and timeouts propagate as ``aiohttp.ClientError`` / ``asyncio.TimeoutError``.
* :func:`parse_label` reads a server's weight-version label as rollstream writes it
  (:class:`WeightLabel`): ``"<version>@<epoch>"`` after a load by the sync owner whose
  fencing epoch is ``epoch``, ``"loading:<version>@<epoch>"`` while it loads, ``"default"`` for
  the weights the server was started with (SGLang and vLLM both start with that label: version 0,
  no epoch); a plain decimal is a version without an epoch. Anything else is no rollstream
  version.
* A call refused by a server's weight fence (HTTP 409: a newer sync owner's epoch was accepted there)
  raises :class:`FencedOut`.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

import aiohttp

from rollstream.config import ServerConfig

INITIAL_WEIGHT_VERSION = "default"  # what SGLang and vLLM report before their first weight update
LOADING_PREFIX = "loading:"
_DECIMAL = re.compile(r"-?\d+")
_LABEL = re.compile(r"(-?\d+)@(\d+)")
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


class FencedOut(HttpRefused):
    """The server's weight fence refused the call: it accepted a newer sync owner's epoch."""


class Retryable(Exception):
    """An HTTP 5xx answer: worth another try, maybe on another server."""


@dataclass(frozen=True)
class WeightLabel:
    """A server's weight-version label, read (see the module docstring).

    ``version`` is None when the label names no weights rollstream can tag with (a load in
    progress, a label rollstream did not write); ``epoch`` is the fencing epoch of the sync owner
    that wrote it (0: none, as for the launch weights).
    """

    version: int | None
    epoch: int = 0
    loading: bool = False


def parse_label(value: Any) -> WeightLabel:
    """The :class:`WeightLabel` of a server's weight-version label."""
    if value == INITIAL_WEIGHT_VERSION:
        return WeightLabel(0)
    if isinstance(value, int) and not isinstance(value, bool):
        return WeightLabel(value)
    if not isinstance(value, str):
        return WeightLabel(None)
    loading = value.startswith(LOADING_PREFIX)
    body = value.removeprefix(LOADING_PREFIX)
    if match := _LABEL.fullmatch(body):
        version, epoch = int(match[1]), int(match[2])
    elif _DECIMAL.fullmatch(body):
        version, epoch = int(body), 0
    else:
        return WeightLabel(None, loading=loading)
    return WeightLabel(None if loading else version, epoch, loading)


def weight_label(version: int, epoch: int) -> str:
    """The label of weights ``version`` loaded by the sync owner with fencing epoch ``epoch``."""
    return f"{version}@{epoch}"


def loading_label(version: int, epoch: int) -> str:
    """The label of a server while it loads ``version``: deliberately no rollstream version."""
    return f"{LOADING_PREFIX}{version}@{epoch}"


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

    async def post(self, url: str, path: str, body: dict[str, Any], timeout: float,
                   headers: dict[str, str] | None = None) -> Any:
        """POST ``body`` as JSON; the decoded JSON answer (see the module docstring for errors)."""
        async with self._client().post(f"{url}{path}", json=body, timeout=self._timeout(timeout),
                                       headers=headers) as resp:
            text = await resp.text()
            if resp.status >= 400:
                message = error_message(text)
                if resp.status >= 500:
                    raise Retryable(f"HTTP {resp.status} from {url}{path}: {message}")
                raise (FencedOut if resp.status == 409 else HttpRefused)(f"{url}{path}", resp.status, message)
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

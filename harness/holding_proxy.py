"""A real HTTP proxy in front of one server that holds the calls a test picks, for as long as the
test wants: a sync owner whose calls go through it stalls exactly between two of its
calls (as a GC pause, a stopped process or a slow network would make it), deterministically.

:class:`ProxiedHttp` is a :class:`~rollstream.engines.server_http.ServerHttp` whose calls to
``target`` go through the proxy, so a sync owner keeps the server's own URL (its lease, its logs)
while its traffic takes the held path.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from rollstream.config import ServerConfig
from rollstream.engines.server_http import ServerHttp

Rule = Callable[[str, Any], bool]  # (path with query, JSON body or None) -> hold it?


class HoldingProxy:
    """Forwards every call to ``target``; a call that matches the rule set by :meth:`hold` waits
    until :meth:`release`. ``held`` is set once such a call arrived (and waits)."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.held = asyncio.Event()
        self.forwarded: list[str] = []  # path and status of every call, in order
        self._rule: Rule | None = None
        self._released = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    def hold(self, rule: Rule) -> None:
        self._rule, self._released = rule, asyncio.Event()
        self.held.clear()

    def release(self) -> None:
        self._rule = None
        self._released.set()

    async def __aenter__(self) -> HoldingProxy:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()
        if self._runner is not None:
            await self._runner.cleanup()  # its handlers end (forwarding what they held) first
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        path = request.path_qs
        if self._rule is not None and self._rule(path, body):
            self.held.set()
            await self._released.wait()
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self._session.request(request.method, f"{self.target}{path}", data=raw, headers=headers) as resp:
            payload = await resp.read()
            self.forwarded.append(f"{request.method} {path} -> {resp.status}")
            return web.Response(body=payload, status=resp.status, content_type=resp.content_type)


class ProxiedHttp(ServerHttp):
    """Calls to ``target`` go to ``proxy`` instead (every other URL as it is)."""

    def __init__(self, settings: ServerConfig, target: str, proxy: HoldingProxy) -> None:
        super().__init__(settings)
        self._target, self._proxy = target.rstrip("/"), proxy

    def _via(self, url: str) -> str:
        return self._proxy.url if url.rstrip("/") == self._target else url

    async def post(self, url: str, path: str, body: dict[str, Any], timeout: float,
                   headers: dict[str, str] | None = None) -> Any:
        return await super().post(self._via(url), path, body, timeout, headers)

    async def get(self, url: str, path: str, timeout: float) -> tuple[int, Any]:
        return await super().get(self._via(url), path, timeout)

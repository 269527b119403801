"""Requests on a real vLLM server: one a test sees running (read from the server's own
metrics), so that a weight update is known to land in its middle; lanes of requests that keep a
server generating while versions change."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from harness.waits import stop_task, within
from rollstream.api.engine import InferenceEngine
from rollstream.api.io_struct import ModelRequest, ModelResponse


async def generating(url: str) -> None:
    """Until the server at ``url`` has a request running."""
    await _until_nonzero(url, "vllm:num_requests_running")


async def queueing(url: str) -> None:
    """Until the server at ``url`` has a request waiting (it runs ``max_num_seqs`` at once)."""
    await _until_nonzero(url, "vllm:num_requests_waiting")


async def _until_nonzero(url: str, gauge: str) -> None:
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{url}/metrics") as resp:
                text = await resp.text()
            if any(line.startswith(gauge) and not line.rstrip().endswith(" 0.0") for line in text.splitlines()):
                return
            await asyncio.sleep(0.01)


async def seen_running(server: object, engine: InferenceEngine, request: ModelRequest, what: str,
                       attempts: int = 5) -> asyncio.Task[ModelResponse]:
    """``request`` on ``engine``, seen running on ``server`` (anything with a ``url``). The
    server's metrics lag (a GET waited 0.5 s on a loaded machine here, as long as 240 tokens
    take), so a request may end unseen: it is dropped and another sent, up to ``attempts`` times."""
    url = str(getattr(server, "url"))
    for _ in range(attempts):
        task = asyncio.create_task(engine.agenerate(request))
        probe = asyncio.create_task(generating(url))
        await within(asyncio.wait({task, probe}, return_when=asyncio.FIRST_COMPLETED), 60, f"{what} running")
        await stop_task(probe, f"the metrics probe for {what}")
        if not task.done():
            return task
        task.result()  # raises what the request raised
    raise AssertionError(f"{what}: ended before the server was seen running it, {attempts} times")


class Lanes:
    """``lanes`` requests on ``engine`` one after another per lane, until :meth:`stop`; every
    response kept (``responses``), every request counted as it starts (``started``)."""

    def __init__(self, engine: InferenceEngine, lanes: int, request: Callable[[int, int], ModelRequest]) -> None:
        self.engine = engine
        self.request = request  # (lane, n-th request of the lane) -> the request
        self.responses: list[ModelResponse] = []
        self.started = 0
        self._tasks = [asyncio.create_task(self._lane(i)) for i in range(lanes)]

    async def _lane(self, lane: int) -> None:
        n = 0
        while True:
            n += 1
            self.started += 1
            self.responses.append(await self.engine.agenerate(self.request(lane, n)))

    def versions(self) -> set[int]:
        """Every version the responses so far carry."""
        return {v for r in self.responses for v in r.output_versions}

    async def stop(self) -> None:
        """Stop every lane; raise what a lane raised."""
        for task in self._tasks:
            await stop_task(task, "a generation lane")
        for task in self._tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

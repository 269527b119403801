"""Requests on a real vLLM server that a test sees running (read from the server's own metrics),
so that a weight update is known to land in their middle."""

from __future__ import annotations

import asyncio

import aiohttp

from harness.waits import stop_task, within
from rollstream.api.engine import InferenceEngine
from rollstream.api.io_struct import ModelRequest, ModelResponse


async def generating(url: str) -> None:
    """Until the server at ``url`` has a request running."""
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{url}/metrics") as resp:
                text = await resp.text()
            if any(line.startswith("vllm:num_requests_running") and not line.rstrip().endswith(" 0.0")
                   for line in text.splitlines()):
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

"""SGLangEngine against the fake SGLang server (tests/fakes): protocol, resume, routing, faults."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import aiohttp
import pytest

from rollstream.api.engine import WeightUpdate
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.engines.sglang import EngineRequestError, EngineUnavailableError, SGLangEngine
from tests.fakes import FakeSGLangServer, free_port
from tests.fakes.sglang_server import SAMPLING_KEYS

pytestmark = pytest.mark.timeout(60)

FAST = dict(backoff_base=0.02, backoff_max=0.1, health_timeout=5.0)


@pytest.fixture
async def servers() -> AsyncIterator[tuple[FakeSGLangServer, FakeSGLangServer]]:
    async with FakeSGLangServer(token_delay=0.002) as a, FakeSGLangServer(token_delay=0.002) as b:
        yield a, b


def request(rid: str | None = None, n: int = 8, **kw: Any) -> ModelRequest:
    req = ModelRequest(input_ids=[11, 12, 13], gconfig=GenerationHyperparameters(max_new_tokens=n, **kw))
    if rid:
        req.rid = rid
    return req


async def run(engine: SGLangEngine, req: ModelRequest) -> ModelResponse:
    return await engine.agenerate(req)


async def until_tokens(*servers: FakeSGLangServer, n: int = 10) -> None:
    """Wait until the servers generated ``n`` tokens: the request is mid-way, even on a slow box."""
    deadline = time.monotonic() + 20
    while sum(s.tokens_out for s in servers) < n:
        assert time.monotonic() < deadline, "no tokens generated"
        await asyncio.sleep(0.002)


async def test_request_has_only_sglang_keys(servers: Any) -> None:
    server = servers[0]
    engine = SGLangEngine([server.url], **FAST)
    try:
        req = request(n=5, greedy=True, min_new_tokens=2, stop=["\n\n"], stop_token_ids=[2], top_p=0.9)
        resp = await run(engine, req)
    finally:
        await engine.close()
    body = server.requests[-1]
    params = body["sampling_params"]
    assert set(params) <= SAMPLING_KEYS and "max_tokens" not in params
    assert params["max_new_tokens"] == 5 and params["min_new_tokens"] == 2
    assert params["temperature"] == 0.0 and params["top_k"] == -1 and params["stop"] == ["\n\n"]
    assert body["input_ids"] == [11, 12, 13] and body["return_logprob"] is True and body["rid"] == req.rid
    assert len(resp.output_tokens) == len(resp.output_logprobs) == len(resp.output_versions) == 5
    assert resp.stop_reason == "length" and all(lp < 0 for lp in resp.output_logprobs)


async def test_fake_server_rejects_openai_names(servers: Any) -> None:
    body = {"input_ids": [1, 2], "sampling_params": {"max_tokens": 4}}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{servers[0].url}/generate", json=body) as resp:
            assert resp.status == 400 and "unknown field" in await resp.text()
        async with session.post(f"{servers[0].url}/pause_generation") as resp:
            assert resp.status == 400  # an empty POST is rejected, as by SGLang


async def test_stop_and_4xx(servers: Any) -> None:
    server = servers[0]
    server.stop_at = 4
    engine = SGLangEngine([server.url], **FAST)
    try:
        resp = await run(engine, request(n=20, stop_token_ids=[2]))
        assert resp.stop_reason == "stop" and len(resp.output_tokens) == 5 and resp.output_tokens[-1] == 2
        server.fail_next(1, status=400)
        with pytest.raises(EngineRequestError):
            await run(engine, request())
    finally:
        await engine.close()


async def test_abort_resume_across_weight_update(servers: Any) -> None:
    server = servers[0]
    engine = SGLangEngine([server.url], **FAST)
    try:
        req = request(rid="r1", n=100, ignore_eos=True)
        task = asyncio.create_task(run(engine, req))
        await until_tokens(server)
        await engine.pause()
        await engine.update_weights(WeightUpdate(version=1, path="/ckpt/v1"))
        await engine.resume()
        resp = await task
    finally:
        await engine.close()
    k = resp.output_versions.index(1)
    assert 0 < k < 100 and resp.output_versions == [0] * k + [1] * (100 - k)
    assert len(resp.output_tokens) == 100 and resp.stop_reason == "length"
    first, second = [b for b in server.requests if b["rid"] == "r1"]
    assert second["input_ids"] == [11, 12, 13] + resp.output_tokens[:k]
    assert second["sampling_params"]["max_new_tokens"] == 100 - k
    assert server.weight_version == "1" and server.model_path == "/ckpt/v1"
    assert server.hits["pause"] == server.hits["continue"] == 1


async def test_final_abort_is_length_and_empty_aborts_back_off(servers: Any) -> None:
    server = servers[0]
    engine = SGLangEngine([server.url], max_retries=2, **FAST)
    try:
        server.abort_after = 6
        resp = await run(engine, request(n=6))
        assert resp.stop_reason == "length" and len(resp.output_tokens) == 6 and engine.stats.resubmissions == 1
        server.abort_after = 0  # aborts without progress, engine not paused: bounded retries
        with pytest.raises(EngineRequestError, match="without progress"):
            await run(engine, request(n=6))
        assert len(server.requests) == 1 + 3
    finally:
        await engine.close()


async def test_sticky_rid_and_least_loaded(servers: Any) -> None:
    a, b = servers
    engine = SGLangEngine([a.url, b.url], **FAST)
    try:
        await asyncio.gather(run(engine, request(rid="x", n=30)), run(engine, request(rid="y", n=30)))
        assert engine.server_for("x") != engine.server_for("y")  # both idle -> spread
        for _ in range(3):
            await run(engine, request(rid="x", n=2))
    finally:
        await engine.close()
    home = a if engine.server_for("x") == a.url else b
    other = b if home is a else a
    assert sum(r["rid"] == "x" for r in home.requests) == 4
    assert not any(r["rid"] == "x" for r in other.requests)


async def test_failover_when_one_server_dies(servers: Any) -> None:
    a, b = servers
    engine = SGLangEngine([a.url, b.url], **FAST)
    try:
        task = asyncio.create_task(run(engine, request(rid="long", n=150, ignore_eos=True)))
        await until_tokens(a, b)
        doomed, survivor = (a, b) if engine.server_for("long") == a.url else (b, a)
        await doomed.go_down()
        resp = await task
        assert len(resp.output_tokens) == 150 and engine.server_for("long") == survivor.url
        results = await asyncio.gather(*(run(engine, request(n=3)) for _ in range(4)))
        assert all(len(r.output_tokens) == 3 for r in results)
        assert engine.stats.servers_marked_down == 1
    finally:
        await engine.close()


async def test_all_down_raises_after_bounded_backoff() -> None:
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    engine = SGLangEngine(urls, max_retries=3, backoff_base=0.05, backoff_max=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(EngineUnavailableError):
            await run(engine, request())
        # 4 attempts, 3 backoffs of at least half of 0.05, 0.1, 0.2 s: no busy loop
        assert engine.stats.http_attempts == 4 and time.monotonic() - started >= 0.17
        with pytest.raises(EngineUnavailableError, match="no SGLang server available"):
            await run(engine, request())
        assert engine.stats.http_attempts == 4  # both marked down: fails fast, no new attempts
    finally:
        await engine.close()


async def test_5xx_is_retried_a_bounded_number_of_times(servers: Any) -> None:
    server = servers[0]
    engine = SGLangEngine([server.url], max_retries=2, failure_threshold=10, **FAST)
    try:
        server.fail_next(2)
        assert len((await run(engine, request(n=3))).output_tokens) == 3
        server.fail_next(100)
        with pytest.raises(EngineUnavailableError, match="3 attempts"):
            await run(engine, request(n=3))
        assert server.hits["generate"] == 3 + 3
    finally:
        await engine.close()


async def test_health_wait_and_unreachable_error(servers: Any) -> None:
    server = servers[0]
    server.healthy = False
    engine = SGLangEngine([server.url], **FAST)
    try:
        starting = asyncio.create_task(engine.start())
        await asyncio.sleep(0.3)
        assert not starting.done()
        server.healthy = True
        await asyncio.wait_for(starting, 5)
    finally:
        await engine.close()
    dead = f"http://127.0.0.1:{free_port()}"
    engine = SGLangEngine([server.url, dead], health_timeout=0.5)
    try:
        with pytest.raises(EngineUnavailableError, match=dead):
            await engine.start()
    finally:
        await engine.close()


async def test_failed_weight_update_excludes_server(servers: Any) -> None:
    a, b = servers
    a.fail_updates = True
    engine = SGLangEngine([a.url, b.url], **FAST)
    try:
        await engine.update_weights(WeightUpdate(version=3, path="/ckpt/v3"))
        assert engine.get_version() == 3
        await asyncio.gather(*(run(engine, request(n=2)) for _ in range(4)))
        assert len(a.requests) == 0 and len(b.requests) == 4
        b.fail_updates = True
        with pytest.raises(EngineUnavailableError):
            await engine.update_weights(WeightUpdate(version=4, path="/ckpt/v4"))
        assert engine.get_version() == 3
    finally:
        await engine.close()

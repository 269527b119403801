"""SGLangEngine against the SGLang stand-in (harness/fake_sglang.py): protocol, tags, resume, routing, faults."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import aiohttp
import pytest

from harness.fake_sglang import FakeSGLangServer, SAMPLING_KEYS
from harness.services import free_port
from rollstream.api.engine import WeightUpdate
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.config import ServerConfig
from rollstream.engines.server_admin import time_epoch
from rollstream.engines.server_http import parse_label
from rollstream.engines.sglang import (
    EngineRequestError,
    EngineUnavailableError,
    NonFiniteLogprobError,
    SGLangEngine,
)


pytestmark = pytest.mark.timeout(60)

FAST = dict(backoff_base_seconds=0.02, backoff_max_seconds=0.1, health_timeout_seconds=5.0,
            version_poll_seconds=0.05)


def engine_for(*servers: FakeSGLangServer | str, **settings: Any) -> SGLangEngine:
    urls = [s if isinstance(s, str) else s.url for s in servers]
    return SGLangEngine(urls, settings=ServerConfig(**{**FAST, **settings}))


@pytest.fixture
async def servers() -> AsyncIterator[tuple[FakeSGLangServer, FakeSGLangServer]]:
    async with FakeSGLangServer(token_delay=0.002) as a, FakeSGLangServer(token_delay=0.002) as b:
        yield a, b


def request(rid: str | None = None, n: int = 8, **kw: Any) -> ModelRequest:
    req = ModelRequest(input_ids=[11, 12, 13], gconfig=GenerationHyperparameters(max_new_tokens=n, **kw))
    if rid:
        req.rid = rid
    return req


async def until(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


async def until_tokens(*servers: FakeSGLangServer, n: int = 10) -> None:
    """Wait until the servers generated ``n`` tokens: the request is mid-way, even on a slow box."""
    await until(lambda: sum(s.tokens_out for s in servers) >= n)


def exact_tags(server: FakeSGLangServer, resp: ModelResponse) -> bool:
    """Every output token is tagged with the weights that produced it on ``server``."""
    context = list(resp.input_tokens)
    for token, logprob, version in zip(resp.output_tokens, resp.output_logprobs, resp.output_versions):
        context.append(token)
        produced = server.ledger.weights_of(context, logprob)
        if {parse_label(v).version for v in produced} != {version}:
            return False
    return True


async def test_request_has_only_sglang_keys(servers: Any) -> None:
    server = servers[0]
    engine = engine_for(server)
    try:
        req = request(n=5, greedy=True, stop_token_ids=[2], top_p=0.9)
        resp = await engine.agenerate(req)
    finally:
        await engine.close()
    body = server.requests[-1]
    params = body["sampling_params"]
    assert set(params) <= SAMPLING_KEYS and "max_tokens" not in params
    assert "min_new_tokens" not in params and "stop" not in params  # unused: not sent
    assert params["max_new_tokens"] == 5 and params["temperature"] == 0.0 and params["top_k"] == -1
    assert body["input_ids"] == [11, 12, 13] and body["return_logprob"] is True
    assert body["rid"] == f"{req.rid}.0"  # one rid per HTTP attempt
    assert len(resp.output_tokens) == len(resp.output_logprobs) == len(resp.output_versions) == 5
    assert resp.stop_reason == "length" and all(lp < 0 for lp in resp.output_logprobs)


async def test_stop_strings_on_a_skip_tokenizer_init_server_fail_with_a_hint(servers: Any) -> None:
    engine = engine_for(servers[0])
    try:
        with pytest.raises(EngineRequestError, match="skip-tokenizer-init"):
            await engine.agenerate(request(stop=["\n\n"]))
        with pytest.raises(EngineRequestError, match="min_new_tokens"):
            await engine.agenerate(request(min_new_tokens=2))
    finally:
        await engine.close()
    assert servers[0].refusals["skip_tokenizer_init"] == 2


async def test_standin_keys_like_sglang(servers: Any) -> None:
    url = servers[0].url
    async with aiohttp.ClientSession() as session:
        body = {"input_ids": [1, 2], "sampling_params": {"max_tokens": 4}}
        async with session.post(f"{url}/generate", json=body) as resp:
            assert resp.status == 400 and "unknown field" in await resp.text()
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "not_an_sglang_key": 1}
        async with session.post(f"{url}/generate", json=body) as resp:
            assert resp.status == 200  # unknown top-level keys are ignored
        async with session.post(f"{url}/pause_generation") as resp:
            assert resp.status == 400  # an empty POST is rejected, as by SGLang


async def test_stop_and_4xx(servers: Any) -> None:
    server = servers[0]
    server.stop_at = 4
    engine = engine_for(server)
    try:
        resp = await engine.agenerate(request(n=20, stop_token_ids=[2]))
        assert resp.stop_reason == "stop" and len(resp.output_tokens) == 5 and resp.output_tokens[-1] == 2
        server.fail_next(1, status=400)
        with pytest.raises(EngineRequestError):
            await engine.agenerate(request())
    finally:
        await engine.close()


async def test_abort_resume_across_weight_update_tags_each_span_as_the_server_reports(servers: Any) -> None:
    server = servers[0]
    engine = engine_for(server)
    try:
        req = request(rid="r1", n=100, ignore_eos=True)
        task = asyncio.create_task(engine.agenerate(req))
        await until_tokens(server)
        await engine.pause()
        await engine.update_weights(WeightUpdate(version=1, path="/ckpt/v1"))
        engine.set_version(1)
        await engine.resume()
        resp = await task
    finally:
        await engine.close()
    k = resp.output_versions.index(1)
    assert 0 < k < 100 and resp.output_versions == [0] * k + [1] * (100 - k)
    assert len(resp.output_tokens) == 100 and resp.stop_reason == "length" and exact_tags(server, resp)
    first, second = [b for b in server.requests if b["rid"].startswith("r1.")]
    assert first["rid"] != second["rid"]  # a resubmission never reuses a rid
    assert second["input_ids"] == [11, 12, 13] + resp.output_tokens[:k]
    assert second["sampling_params"]["max_new_tokens"] == 100 - k
    assert server.version == 1 and server.model_path == "/ckpt/v1"
    assert server.hits["pause"] == server.hits["continue"] == 1


async def test_tags_follow_the_server_not_the_client(servers: Any) -> None:
    """Another actor (the server's owner) reloads the server: this client, which did nothing
    and still believes in version 0, tags the new tokens with the server's version."""
    server = servers[0]
    owner, engine = engine_for(server), engine_for(server)
    try:
        task = asyncio.create_task(engine.agenerate(request(n=120, ignore_eos=True)))
        await until_tokens(server, n=20)
        await owner.pause()
        await owner.update_weights(WeightUpdate(version=7, path="/ckpt/v7"))
        await owner.resume()
        resp = await task
    finally:
        await owner.close()
        await engine.close()
    assert engine.get_version() == 0 and set(resp.output_versions) == {0, 7}
    assert exact_tags(server, resp)


async def test_request_arriving_while_paused_waits_at_the_gate(servers: Any) -> None:
    server = servers[0]
    engine = engine_for(server)
    try:
        await engine.pause()
        task = asyncio.create_task(engine.agenerate(request(n=5)))
        await asyncio.sleep(0.3)
        assert not task.done() and server.hits["generate"] == 1  # held at the server's gate
        await engine.update_weights(WeightUpdate(version=2, path="/ckpt/v2"))
        await engine.resume()
        resp = await task
    finally:
        await engine.close()
    assert resp.output_versions == [2] * 5 and engine.stats.resubmissions == 0  # not aborted


async def test_retry_after_a_client_timeout_is_not_refused_as_a_duplicate(servers: Any) -> None:
    """The first attempt times out at the client while the server still holds its rid (held at
    the paused gate); the retry has a rid of its own and is served."""
    server = servers[0]
    owner, engine = engine_for(server), engine_for(server, request_timeout_seconds=0.4, failure_threshold=10)
    try:
        await owner.pause()
        task = asyncio.create_task(engine.agenerate(request(n=4)))
        await until(lambda: engine.stats.http_failures >= 1)
        await owner.resume()
        resp = await task
    finally:
        await owner.close()
        await engine.close()
    assert len(resp.output_tokens) == 4 and server.refusals["duplicate_rid"] == 0
    rids = [b["rid"] for b in server.requests]
    assert len(rids) >= 2 and len(set(rids)) == len(rids)


async def test_duplicate_rid_answer_is_retried_with_a_new_rid(servers: Any) -> None:
    server = servers[0]
    server.token_delay = 0.01
    engine = engine_for(server)
    try:
        async with aiohttp.ClientSession() as session:  # someone else holds "dup.0" for ~1 s
            body = {"input_ids": [5, 6], "rid": "dup.0", "sampling_params": {"max_new_tokens": 100}}
            other = asyncio.create_task(session.post(f"{server.url}/generate", json=body))
            await until(lambda: server.tokens_out > 0)
            resp = await engine.agenerate(request(rid="dup", n=3))
            (await other).release()
    finally:
        await engine.close()
    assert len(resp.output_tokens) == 3 and engine.stats.duplicate_rids == 1
    assert server.refusals["duplicate_rid"] == 1


async def test_null_logprob_fails_the_request_with_a_reason(servers: Any) -> None:
    server = servers[0]
    server.null_logprob_next = 1
    engine = engine_for(server)
    try:
        with pytest.raises(NonFiniteLogprobError, match="null .*logprob for output token 0"):
            await engine.agenerate(request(n=4))
        assert len((await engine.agenerate(request(n=4))).output_tokens) == 4  # the next one is fine
    finally:
        await engine.close()


async def test_a_server_behind_the_trainer_is_not_used_until_it_caught_up(servers: Any) -> None:
    a, b = servers
    owner, engine = engine_for(a, b), engine_for(a, b)
    try:
        await owner.update_weights(WeightUpdate(version=3, path="/ckpt/v3"))
        await owner.admin.load(b.url, WeightUpdate(version=2, path="/ckpt/v2"), time_epoch())  # b goes back to 2
        await engine.start()  # reads each server's version
        engine.set_version(3)
        for _ in range(4):
            assert set((await engine.agenerate(request(n=2))).output_versions) == {3}
        assert len(b.requests) == 0 and len(a.requests) == 4
        engine.set_version(4)  # nobody is at 4 yet: calls wait, then go to whoever catches up
        task = asyncio.create_task(engine.agenerate(request(n=2)))
        await asyncio.sleep(0.3)
        assert not task.done() and engine.stats.catch_up_waits == 1
        await owner.admin.load(b.url, WeightUpdate(version=4, path="/ckpt/v4"), time_epoch())
        assert (await task).output_versions == [4, 4] and len(b.requests) == 1
    finally:
        await owner.close()
        await engine.close()


async def test_catch_up_wait_is_bounded(servers: Any) -> None:
    engine = engine_for(servers[0], catch_up_timeout_seconds=0.3)
    engine.set_version(5)
    try:
        with pytest.raises(EngineUnavailableError, match="no SGLang server reached weight version 5"):
            await engine.agenerate(request())
    finally:
        await engine.close()


async def test_span_from_a_restarted_server_is_discarded_and_regenerated(servers: Any) -> None:
    """The server restarts on its launch weights mid-request: the client's retry reaches it
    before the client knows; that older span is discarded, and the rest waits for the owner."""
    server = servers[0]
    server.token_delay = 0.01
    owner, engine = engine_for(server), engine_for(server, failure_threshold=10)
    try:
        await owner.update_weights(WeightUpdate(version=1, path="/ckpt/v1"))
        engine.set_version(1)
        task = asyncio.create_task(engine.agenerate(request(n=60, ignore_eos=True)))
        await until_tokens(server, n=10)
        await server.go_down()
        await server.come_up(fresh=True)  # back on "default" weights (version 0)
        await until(lambda: engine.stats.stale_spans >= 1 or task.done())
        await owner.admin.load(server.url, WeightUpdate(version=1, path="/ckpt/v1"), time_epoch())
        resp = await task
    finally:
        await owner.close()
        await engine.close()
    assert set(resp.output_versions) == {1} and len(resp.output_tokens) == 60
    assert engine.stats.stale_spans == 1


async def test_final_abort_is_length_and_empty_aborts_back_off(servers: Any) -> None:
    server = servers[0]
    engine = engine_for(server, max_retries=2)
    try:
        server.abort_after = 6
        resp = await engine.agenerate(request(n=6))
        assert resp.stop_reason == "length" and len(resp.output_tokens) == 6 and engine.stats.resubmissions == 1
        server.abort_after = 0  # aborts without progress: bounded retries
        with pytest.raises(EngineRequestError, match="without progress"):
            await engine.agenerate(request(n=6))
        assert len(server.requests) == 1 + 3
    finally:
        await engine.close()


async def test_sticky_rid_and_least_loaded(servers: Any) -> None:
    a, b = servers
    engine = engine_for(a, b)
    try:
        await asyncio.gather(engine.agenerate(request(rid="x", n=30)), engine.agenerate(request(rid="y", n=30)))
        assert engine.server_for("x") != engine.server_for("y")  # both idle -> spread
        for _ in range(3):
            await engine.agenerate(request(rid="x", n=2))
    finally:
        await engine.close()
    home = a if engine.server_for("x") == a.url else b
    other = b if home is a else a
    assert sum(r["rid"].startswith("x.") for r in home.requests) == 4
    assert not any(r["rid"].startswith("x.") for r in other.requests)


async def test_failover_when_one_server_dies(servers: Any) -> None:
    a, b = servers
    engine = engine_for(a, b)
    try:
        task = asyncio.create_task(engine.agenerate(request(rid="long", n=150, ignore_eos=True)))
        await until_tokens(a, b)
        doomed, survivor = (a, b) if engine.server_for("long") == a.url else (b, a)
        await doomed.go_down()
        resp = await task
        assert len(resp.output_tokens) == 150 and engine.server_for("long") == survivor.url
        results = await asyncio.gather(*(engine.agenerate(request(n=3)) for _ in range(4)))
        assert all(len(r.output_tokens) == 3 for r in results)
        assert engine.stats.servers_marked_down == 1
    finally:
        await engine.close()


async def test_all_down_raises_after_bounded_backoff() -> None:
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    engine = SGLangEngine(urls, settings=ServerConfig(max_retries=3, backoff_base_seconds=0.05,
                                                      backoff_max_seconds=1.0, down_patience_seconds=0))
    engine.servers[0].version = engine.servers[1].version = 0  # as if start() had read them
    try:
        started = time.monotonic()
        with pytest.raises(EngineUnavailableError):
            await engine.agenerate(request())
        # 4 attempts, 3 backoffs of at least half of 0.05, 0.1, 0.2 s: no busy loop
        assert engine.stats.http_attempts == 4 and time.monotonic() - started >= 0.17
        with pytest.raises(EngineUnavailableError, match="no SGLang server available"):
            await engine.agenerate(request())
        assert engine.stats.http_attempts == 4  # both marked down: fails fast, no new attempts
    finally:
        await engine.close()


async def test_with_every_server_down_calls_wait_for_one_to_come_back(servers: Any) -> None:
    server, other = servers
    engine = engine_for(server, other, failure_threshold=1, down_cooldown_seconds=600, down_patience_seconds=20)
    try:
        await engine.start()
        await server.go_down()
        await other.go_down()  # both crashed: the calls below wait instead of failing their samples
        waiting = [asyncio.create_task(engine.agenerate(request(n=3))) for _ in range(3)]
        await until(lambda: engine.stats.servers_marked_down == 2)
        await asyncio.sleep(0.5)
        assert not any(t.done() for t in waiting)
        await other.come_up(fresh=True)  # restarted: answers a probe long before its cooldown ends
        results = await asyncio.gather(*waiting)
        assert all(len(r.output_tokens) == 3 and r.output_versions == [0] * 3 for r in results)
    finally:
        await engine.close()


async def test_every_server_down_past_the_patience_fails_the_call(servers: Any) -> None:
    server = servers[0]
    engine = engine_for(server, failure_threshold=1, down_cooldown_seconds=600, down_patience_seconds=1.0)
    try:
        await engine.start()
        await server.go_down()
        started = time.monotonic()
        with pytest.raises(EngineUnavailableError, match="no SGLang server available within 1.0s"):
            await engine.agenerate(request())
        assert 1.0 <= time.monotonic() - started < 10
    finally:
        await engine.close()


async def test_5xx_is_retried_a_bounded_number_of_times(servers: Any) -> None:
    server = servers[0]
    engine = engine_for(server, max_retries=2, failure_threshold=10)
    try:
        server.fail_next(2)
        assert len((await engine.agenerate(request(n=3))).output_tokens) == 3
        server.fail_next(100)
        with pytest.raises(EngineUnavailableError, match="3 attempts"):
            await engine.agenerate(request(n=3))
        assert server.hits["generate"] == 3 + 3
    finally:
        await engine.close()


async def test_start_waits_for_servers_that_are_down_not_for_paused_ones(servers: Any) -> None:
    a, b = servers
    a.healthy = False  # /health 503 but /model_info answers: up (e.g. paused for an update)
    await b.go_down()
    engine = engine_for(a, b)
    try:
        starting = asyncio.create_task(engine.start())
        await asyncio.sleep(0.3)
        assert not starting.done()  # b answers nothing yet
        await b.come_up()
        await asyncio.wait_for(starting, 5)
        assert engine.server_versions() == {a.url: 0, b.url: 0}
    finally:
        await engine.close()
    dead = f"http://127.0.0.1:{free_port()}"
    engine = engine_for(a, dead, health_timeout_seconds=0.5)
    try:
        await engine.start()  # one server up: start, the dead one is marked down
        assert engine.stats.servers_marked_down == 1
    finally:
        await engine.close()
    engine = engine_for(dead, health_timeout_seconds=0.5)
    try:
        with pytest.raises(EngineUnavailableError, match=dead):
            await engine.start()
    finally:
        await engine.close()


async def test_failed_weight_update_leaves_the_server_behind(servers: Any) -> None:
    a, b = servers
    a.fail_updates = True
    engine = engine_for(a, b)
    try:
        await engine.start()
        await engine.update_weights(WeightUpdate(version=3, path="/ckpt/v3"))
        engine.set_version(3)
        await asyncio.gather(*(engine.agenerate(request(n=2)) for _ in range(4)))
        assert len(a.requests) == 0 and len(b.requests) == 4
        b.fail_updates = True
        with pytest.raises(EngineUnavailableError):
            await engine.update_weights(WeightUpdate(version=4, path="/ckpt/v4"))
        assert engine.server_versions() == {a.url: 0, b.url: 3}
    finally:
        await engine.close()


async def test_image_data_goes_as_sglang_takes_it_with_every_submission(servers: Any) -> None:
    import base64

    from rollstream.api.engine import InvalidRequestError
    from harness.images import noise_png

    server = servers[0]
    png = noise_png(3)
    engine = engine_for(server)
    try:
        req = request(rid="img", n=60, ignore_eos=True)
        req.image_data = [base64.b64encode(png).decode(), png, "/data/cat.png"]  # type: ignore[list-item]
        task = asyncio.create_task(engine.agenerate(req))
        await until_tokens(server)
        await engine.pause()  # the abort makes the engine resubmit the rest
        await engine.resume()
        await task
        with pytest.raises(InvalidRequestError, match=r"image_data\[0\] is a int"):
            await engine.agenerate(ModelRequest(input_ids=[1], image_data=[7]))  # type: ignore[list-item]
    finally:
        await engine.close()
    bodies = [b for b in server.requests if b["rid"].startswith("img.")]
    assert len(bodies) == 2 and server.refusals["bad_body"] == 0
    expected = [base64.b64encode(png).decode()] * 2 + ["/data/cat.png"]
    assert all(b["image_data"] == expected for b in bodies)
    async with aiohttp.ClientSession() as session:  # the stand-in refuses what SGLang's request class would
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "image_data": [[1, 2]]}
        async with session.post(f"{server.url}/generate", json=body) as resp:
            assert resp.status == 400 and "image_data" in await resp.text()

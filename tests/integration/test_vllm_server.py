"""The vLLM engine and its sync owners against a REAL vLLM server (CPU) and Redis.

The session's server (tests/conftest.py: ``vllm_server``) serves the tiny model; each test puts
it back on those weights first. Checkpoints of later versions are perturbed copies, so a token
tagged with the wrong version has a logprob that version's weights do not give: every
generated token is audited by recomputing its logprob with the weights of its tag
(harness/logprob_audit.py).

Asserted: what the server answers (token ids, logprobs of the served weights after temperature,
stop and length, greedy repeats); that a weight update landing mid-generation, a request held
at the gate of a paused server and a label saying "loading" on a running server leave
every token tagged with the weights that produced it; that three owners competing for the
server load each version once; that a server left paused is continued by its owner; that
AReaL's own RLVR and multi-turn workflows run on the engine unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis

from harness.checkpoints import fresh_engine, save_versions
from harness.vllm_requests import seen_running
from harness.logprob_audit import LogprobAuditor
from harness.waits import until, within
from rollstream.api.engine import WeightUpdate
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.config import ServerConfig
from rollstream.dev.vllm_server import LocalVLLMServer
from rollstream.engines.vllm import VLLMEngine
from rollstream.engines.server_admin import time_epoch
from rollstream.engines.server_http import loading_label, weight_label
from rollstream.rollout_workers.weight_sync import SyncCandidate
from rollstream.state.client import RedisKeys
from rollstream.state.server_lease import ServerLeases


pytestmark = [pytest.mark.broker, pytest.mark.timeout(300)]

SETTINGS = ServerConfig(lease_ttl_seconds=10.0, reconcile_seconds=0.5, version_poll_seconds=0.05,
                        backoff_base_seconds=0.05, backoff_max_seconds=0.5, health_timeout_seconds=60)
PROMPT = [11, 12, 13, 14, 15]
LONG = 960  # tokens of the request a weight update cuts: a few seconds here (the server takes 1024)


@pytest.fixture(scope="module")
def weights(vllm_server: LocalVLLMServer, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """v0: the server's launch weights; v1, v2: distinct perturbed copies."""
    return save_versions(Path(vllm_server.model), tmp_path_factory.mktemp("vllm-versions"), 2)


@pytest.fixture
async def engine(vllm_server: LocalVLLMServer) -> AsyncIterator[VLLMEngine]:
    async with fresh_engine(vllm_server, SETTINGS) as started:
        yield started


def request(n: int, **settings: object) -> ModelRequest:
    return ModelRequest(input_ids=list(PROMPT), gconfig=GenerationHyperparameters(max_new_tokens=n, **settings))


def audit(responses: list[ModelResponse], weights: list[Path], temperature: float = 1.0) -> LogprobAuditor:
    checker = LogprobAuditor(weights, temperature)
    for i, resp in enumerate(responses):
        n = len(resp.input_tokens)
        checker.row(resp.input_tokens + resp.output_tokens, [False] * n + [True] * len(resp.output_tokens),
                    [0.0] * n + resp.output_logprobs, [-1] * n + resp.output_versions, f"response {i}")
    return checker


async def test_token_ids_logprobs_stop_and_length(engine: VLLMEngine, weights: list[Path]) -> None:
    # ignore_eos: a sample may draw EOS (token 0) early; the length stop is what is checked here
    sampled = await engine.agenerate(request(24, temperature=0.7, ignore_eos=True))
    assert len(sampled.output_tokens) == 24 and sampled.stop_reason == "length"
    assert sampled.output_versions == [0] * 24
    checked = audit([sampled], weights, temperature=0.7).result  # processed logprobs: after temperature
    assert checked.tokens == 24 and checked.mistagged == 0, checked.examples

    greedy = [await engine.agenerate(request(8, greedy=True)) for _ in range(2)]
    assert greedy[0].output_tokens == greedy[1].output_tokens
    stop_at = greedy[0].output_tokens[3]
    first = greedy[0].output_tokens.index(stop_at)
    stopped = await engine.agenerate(request(8, greedy=True, stop_token_ids=[stop_at]))
    assert stopped.stop_reason == "stop" and stopped.output_tokens == greedy[0].output_tokens[: first + 1]


@contextlib.asynccontextmanager
async def owners(url: str, engine: VLLMEngine, client: aioredis.Redis, name: str,
                 n: int = 3) -> AsyncIterator[list[SyncCandidate]]:
    keys = RedisKeys(name, "t0")
    running = [SyncCandidate(url, engine.admin, ServerLeases(client, keys, f"w{i}", SETTINGS.lease_ttl_seconds),
                           SETTINGS) for i in range(n)]
    tasks = [asyncio.create_task(o.run()) for o in running]
    try:
        await until(lambda: sum(o.lease is not None and o.lease.valid() for o in running) == 1, "one lease holder")
        yield running
    finally:
        for task in tasks:
            task.cancel()
        await within(asyncio.gather(*tasks, return_exceptions=True), 10, "stopping the owners")


async def test_updates_mid_generation_and_at_the_gate_tag_every_token(
    vllm_server: LocalVLLMServer, engine: VLLMEngine, weights: list[Path], redis_client: aioredis.Redis,
    unique_name: str,
) -> None:
    url = vllm_server.url
    async with owners(url, engine, redis_client, unique_name) as running:
        # 1. A version lands while a long generation runs: the owner's pause cuts it off, the
        #    engine resubmits prompt + partial output, the rest comes from the new weights.
        long = await seen_running(vllm_server, engine, request(LONG, ignore_eos=True), "the long request")
        for owner in running:
            owner.offer(WeightUpdate(1, str(weights[1])))
        cut = await within(long, 120, "the long request")
        assert cut.stop_reason == "length" and len(cut.output_tokens) == LONG
        assert cut.output_versions[0] == 0 and cut.output_versions[-1] == 1
        assert cut.output_versions == sorted(cut.output_versions), "oldest first"
        assert engine.stats.resubmissions >= 1
        loads = sum(o.loads for o in running)

    # 2. A request sent to a server this engine still believes current, while the server is
    #    paused mid-update (by the test, acting as the server's owner now that the owners
    #    stopped): it waits at the gate and is generated by the new weights, which the
    #    server's label says.
    epoch = time_epoch()
    fence = {"X-Rollstream-Epoch": str(epoch)}
    await engine.admin.pause(url, epoch)
    await engine.admin.http.post(url, "/update_weight_version", {"new_version": loading_label(2, epoch)}, 5, fence)
    gated = asyncio.create_task(engine.agenerate(request(16)))
    await asyncio.sleep(0.5)
    assert not gated.done(), "a paused server holds the request"
    await engine.admin.load(url, WeightUpdate(2, str(weights[2])), epoch)
    await engine.admin.resume(url, epoch)
    held = await within(gated, 60, "the gated request")
    assert held.output_versions == [2] * 16

    # 3. A server labelled as loading while it runs (an owner's load on a running server): the
    #    tokens made while it is so labelled are thrown away and made again once it names a
    #    version. The request waits at the gate until the label says loading, and the label
    #    names a version again only after the engine threw the first answer away: no race with
    #    a fast generation.
    await engine.admin.pause(url, epoch)
    sent = engine.stats.http_attempts
    late = asyncio.create_task(engine.agenerate(request(240, ignore_eos=True)))
    await until(lambda: engine.stats.http_attempts > sent, "the late request sent")
    await engine.admin.http.post(url, "/update_weight_version", {"new_version": loading_label(3, epoch)}, 5, fence)
    await engine.admin.resume(url, epoch)
    await until(lambda: engine.stats.unlabelled_spans >= 1 or late.done(), "the late request's loading-time answer",
                timeout=60)
    await engine.admin.http.post(url, "/update_weight_version", {"new_version": weight_label(2, epoch)}, 5, fence)
    relabelled = await within(late, 120, "the request cut by a late load")
    assert relabelled.output_versions == [2] * 240 and engine.stats.unlabelled_spans >= 1

    result = audit([cut, held, relabelled], weights).result
    print(f"\n{result}")
    assert result.mistagged == 0 and result.rows_with_several_versions == 1, result.examples
    assert loads == 1, loads  # v1 once, by the one holder


async def test_an_owner_continues_a_server_left_paused(
    vllm_server: LocalVLLMServer, engine: VLLMEngine, redis_client: aioredis.Redis, unique_name: str,
) -> None:
    url = vllm_server.url
    await engine.admin.pause(url, time_epoch())  # a predecessor died between its pause and its continue
    quick = msgspec.structs.replace(SETTINGS, reconcile_seconds=0.3)
    keys = RedisKeys(unique_name, "t0")
    owner = SyncCandidate(url, engine.admin, ServerLeases(redis_client, keys, "w0", quick.lease_ttl_seconds), quick)
    task = asyncio.create_task(owner.run())
    try:
        answer = await within(engine.agenerate(request(4)), 60, "generation on the continued server")
        assert answer.output_versions == [0] * 4
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_areal_workflows_run_unchanged_on_it(engine: VLLMEngine, weights: list[Path]) -> None:
    from transformers import AutoTokenizer

    from rollstream.testing import check_workflow
    from tests.areal_pkg.rewards import answer_reward
    from tests.reference_libs import import_reference

    cli_args = import_reference("areal.api.cli_args")
    tok = AutoTokenizer.from_pretrained(str(weights[0]))
    data = {"messages": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"}
    areal_kwargs = {"reward_fn": answer_reward, "gconfig": cli_args.GenerationHyperparameters(max_new_tokens=8),
                    "tokenizer": tok}
    rlvr = await check_workflow("areal.workflow.rlvr:RLVRWorkflow", data, n=4, engine=engine,
                                workflow_kwargs=areal_kwargs)
    multi = await check_workflow("areal.workflow.multi_turn:MultiTurnWorkflow", data, n=2, engine=engine,
                                 workflow_kwargs={**areal_kwargs, "max_turns": 2, "turn_discount": 0.5})
    responses = [resp for check in (rlvr, multi) for sample in check.samples for resp in sample.responses]
    for sample in rlvr.samples:
        (resp,) = sample.responses
        row = sample.tensors
        assert row is not None and resp.output_len > 0
        prompt = len(resp.input_tokens)
        assert row["logprobs"][0, prompt:].tolist() == resp.output_logprobs  # the server's, as AReaL keeps them
        assert row["versions"][0].tolist() == [-1] * prompt + [0] * resp.output_len
    result = audit(responses, weights).result
    assert result.mistagged == 0 and result.tokens > 0, result.examples

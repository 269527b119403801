"""The weight path against a REAL vLLM server (CPU) and Redis: fenced, all or nothing.

Checkpoints of later versions are perturbed copies of the tiny model, so a token tagged with
the wrong version has a logprob that version's weights do not give: every generated token is
audited by recomputing its logprob with the weights of its tag (harness/logprob_audit.py).

Asserted: a former sync owner whose last call (its label) arrives after its successor
took the server over changes nothing, whether its version is older or newer than the
successor's (a real proxy holds the call, deterministically); a checkpoint with a parameter
renamed, or missing, is refused naming it, keeps the ``loading:`` label, and no token is ever
tagged with its version; with ``weight_update_mode: keep`` running requests are frozen, not
cut, and each token's logprob is what the mix of keys and values the server kept gives; a
request an update cuts before its first token is no failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis
from safetensors.torch import load_file, save_file

from harness.checkpoints import fresh_engine, save_versions
from harness.holding_proxy import HoldingProxy, ProxiedHttp
from harness.logprob_audit import LogprobAuditor, LogprobTagAudit
from harness.vllm_requests import Lanes, queueing, seen_running
from harness.waits import stop_task, until, within
from rollstream.api.engine import WeightUpdate
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.config import ServerConfig
from rollstream.dev.vllm_server import LocalVLLMServer
from rollstream.engines.server_admin import WeightLoadError, time_epoch
from rollstream.engines.vllm import VLLMEngine
from rollstream.engines.vllm_admin import VLLMAdmin
from rollstream.rollout_workers.weight_sync import SyncCandidate
from rollstream.state.client import RedisKeys
from rollstream.state.server_lease import ServerLeases

pytestmark = [pytest.mark.broker, pytest.mark.timeout(300)]

TTL = 2.0
SETTINGS = ServerConfig(lease_ttl_seconds=TTL, reconcile_seconds=0.5, version_poll_seconds=0.05,
                        backoff_base_seconds=0.05, backoff_max_seconds=0.5, health_timeout_seconds=60)
PROMPT = [11, 12, 13, 14, 15]
RENAMED = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def weights(vllm_server: LocalVLLMServer, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """v0: the server's launch weights; v1, v2: distinct perturbed copies."""
    return save_versions(Path(vllm_server.model), tmp_path_factory.mktemp("weight-path"), 2)


@pytest.fixture
async def engine(vllm_server: LocalVLLMServer) -> AsyncIterator[VLLMEngine]:
    async with fresh_engine(vllm_server, SETTINGS) as started:
        yield started


def lanes_of(engine: VLLMEngine) -> Lanes:
    """Three lanes of 48-token requests until stopped."""
    return Lanes(engine, 3, lambda lane, n: ModelRequest(input_ids=list(PROMPT),
                                                          gconfig=GenerationHyperparameters(max_new_tokens=48)))


def audit(responses: list[ModelResponse], weights: list[Path], kv: str = "recomputed") -> LogprobTagAudit:
    checker = LogprobAuditor(weights, kv=kv)
    for i, resp in enumerate(responses):
        n = len(resp.input_tokens)
        checker.row(resp.input_tokens + resp.output_tokens, [False] * n + [True] * len(resp.output_tokens),
                    [0.0] * n + resp.output_logprobs, [-1] * n + resp.output_versions, f"response {i}")
    return checker.result


def owner(url: str, admin: VLLMAdmin, client: aioredis.Redis, name: str, who: str, mode: str = "abort") -> SyncCandidate:
    return SyncCandidate(url, admin, ServerLeases(client, RedisKeys(name, "t0"), who, TTL), SETTINGS, mode)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def owned_engine(server: LocalVLLMServer, settings: ServerConfig, client: aioredis.Redis, name: str,
                       mode: str) -> AsyncIterator[tuple[VLLMEngine, SyncCandidate]]:
    """An engine on ``server`` (back on its launch weights) and the server's sync owner
    in ``mode``, holding its lease; both stopped after."""
    async with fresh_engine(server, settings, mode) as engine:
        keeper = SyncCandidate(server.url, engine.admin, ServerLeases(client, RedisKeys(name, "t0"), "w0", TTL),
                             settings, mode)  # type: ignore[arg-type]
        task = asyncio.create_task(keeper.run())
        try:
            await until(lambda: keeper.lease is not None, "the lease")
            yield engine, keeper
        finally:
            await stop_task(task, "the owner")


def final_label(path: str, body: object) -> bool:
    """The call that labels loaded weights with their version (not the loading label)."""
    return path == "/update_weight_version" and not str((body or {}).get("new_version", "")).startswith("loading:")


@pytest.mark.parametrize(("late", "successor"), [(1, 2), (2, 1)], ids=["late-owner-older", "late-owner-newer"])
async def test_a_former_owner_labels_nothing_after_its_successor(
    vllm_server: LocalVLLMServer, engine: VLLMEngine, weights: list[Path], redis_client: aioredis.Redis,
    unique_name: str, late: int, successor: int,
) -> None:
    url = vllm_server.url
    generation = lanes_of(engine)
    async with HoldingProxy(url) as proxy:
        # The old owner loads `late`; its last call, the label, is held in flight.
        proxy.hold(final_label)
        old = owner(url, VLLMAdmin(ProxiedHttp(SETTINGS, url, proxy)), redis_client, unique_name, "old")
        old.offer(WeightUpdate(late, str(weights[late])))
        old_task = asyncio.create_task(old.run())
        await within(proxy.held.wait(), 60, "the old owner's label reaching the proxy")
        assert old.lease is not None
        old_token = old.lease.token
        # The old owner stops (its lease ends, as a stalled owner's would expire); its label is
        # still in flight. The successor takes the server over and loads `successor`.
        new = owner(url, engine.admin, redis_client, unique_name, "new")
        new.offer(WeightUpdate(successor, str(weights[successor])))
        await stop_task(old_task, "the old owner")
        new_task = asyncio.create_task(new.run())
        await until(lambda: new.loads == 1, "the successor's load", timeout=60)
        assert new.lease is not None and new.lease.token > old_token
        await until(lambda: successor in generation.versions(), f"tokens of v{successor}", timeout=60)
        # The old owner's late label arrives now: refused.
        proxy.release()
        await until(lambda: any("/update_weight_version -> 409" in f for f in proxy.forwarded),
                    "the late label refused", timeout=30)
        seen = len(generation.responses)
        await until(lambda: len(generation.responses) >= seen + 6, "responses after the late label", timeout=60)
        label = await engine.admin.label(url)
        assert (label.version, label.epoch) == (successor, new.lease.token), label
        await generation.stop()
        await stop_task(new_task, "the successor")

    result = audit(generation.responses, weights)
    print(f"\n{result}; forwarded for the old owner: {proxy.forwarded}")
    assert result.mistagged == 0 and successor in result.versions, result.examples


def broken_checkpoint(good: Path, out: Path, how: str) -> Path:
    """``good`` with one parameter renamed, or removed."""
    shutil.copytree(good, out)
    tensors = load_file(out / "model.safetensors")
    value = tensors.pop(RENAMED)
    if how == "renamed":
        tensors[RENAMED + "_renamed"] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


async def test_a_partial_load_keeps_the_loading_label_and_tags_nothing(
    vllm_server: LocalVLLMServer, engine: VLLMEngine, weights: list[Path], redis_client: aioredis.Redis,
    unique_name: str, tmp_path: Path,
) -> None:
    url = vllm_server.url
    renamed = broken_checkpoint(weights[1], tmp_path / "renamed", "renamed")
    removed = broken_checkpoint(weights[1], tmp_path / "removed", "removed")
    epoch = time_epoch()
    await engine.admin.pause(url, epoch)
    try:
        with pytest.raises(WeightLoadError, match="down_proj.weight_renamed"):
            await engine.admin.load(url, WeightUpdate(1, str(renamed)), epoch)
        with pytest.raises(WeightLoadError, match=r"not written: \['model.layers.1.mlp.down_proj.weight'\]"):
            await engine.admin.load(url, WeightUpdate(1, str(removed)), epoch)
        label = await engine.admin.label(url)
        assert label.loading and label.version is None, label
    finally:
        await engine.admin.resume(url, epoch)

    # An owner offered the renamed checkpoint as v1: it fails, the server keeps a label no worker
    # trusts, and generation waits; then v2 lands and generation goes on with it.
    generation = lanes_of(engine)
    keeper = owner(url, engine.admin, redis_client, unique_name, "w0")
    keeper.offer(WeightUpdate(1, str(renamed)))
    task = asyncio.create_task(keeper.run())
    try:
        await until(lambda: keeper.failed_loads >= 2, "two failed loads of the renamed checkpoint", timeout=60)
        assert (await engine.admin.label(url)).loading
        keeper.offer(WeightUpdate(2, str(weights[2])))
        await until(lambda: 2 in generation.versions(), "tokens of v2", timeout=60)
    finally:
        await generation.stop()
        await stop_task(task, "the owner")
    result = audit(generation.responses, weights)
    print(f"\n{result}")
    assert 1 not in result.versions and result.mistagged == 0 and 2 in result.versions, result


async def test_keep_freezes_running_requests_and_tags_each_step(
    vllm_keep_server: LocalVLLMServer, weights: list[Path], redis_client: aioredis.Redis, unique_name: str,
) -> None:
    async with owned_engine(vllm_keep_server, SETTINGS, redis_client, unique_name, "keep") as (engine, keeper):
        long = ModelRequest(input_ids=list(PROMPT), gconfig=GenerationHyperparameters(max_new_tokens=900, ignore_eos=True))
        first = await seen_running(vllm_keep_server, engine, long, "the long requests")
        others = [asyncio.create_task(engine.agenerate(long)) for _ in range(2)]
        keeper.offer(WeightUpdate(1, str(weights[1])))
        await until(lambda: keeper.loads == 1, "the load of v1", timeout=60)
        keeper.offer(WeightUpdate(2, str(weights[2])))
        responses = await within(asyncio.gather(first, *others), 120, "the frozen requests")
    kept = audit(responses, weights, kv="kept")
    recomputed = audit(responses, weights)
    print(f"\nkept: {kept}; recomputed as if cut: {recomputed.mistagged} tokens disagree")
    assert engine.stats.resubmissions == 0 and engine.stats.update_cuts == 0, engine.stats
    assert all(len(r.output_tokens) == 900 and r.output_versions == sorted(r.output_versions) for r in responses)
    assert kept.mistagged == 0 and kept.rows_with_several_versions >= 1, kept.examples
    assert recomputed.mistagged > 0  # the kept keys and values are what the server used: the audit can tell


async def test_requests_a_weight_update_cuts_before_their_first_token_never_fail(
    vllm_server: LocalVLLMServer, weights: list[Path], redis_client: aioredis.Redis, unique_name: str,
) -> None:
    """More requests than the server runs at once (8): the ones still queued when the owner's
    pause aborts everything come back with no token. With max_retries 0 each such answer used to
    fail its sample; a weight update's cut is no failure."""
    strict = msgspec.structs.replace(SETTINGS, max_retries=0)
    async with owned_engine(vllm_server, strict, redis_client, unique_name, "abort") as (engine, keeper):
        many = ModelRequest(input_ids=list(PROMPT), gconfig=GenerationHyperparameters(max_new_tokens=300, ignore_eos=True))
        requests = [asyncio.create_task(engine.agenerate(many)) for _ in range(16)]
        # the update lands once some are queued on the server (8 run, the rest wait): offered at
        # once, it could pause the server before the queued requests reached it (seen: 0 cut
        # before their first token)
        await within(queueing(vllm_server.url), 60, "a request queued on the server")
        keeper.offer(WeightUpdate(1, str(weights[1])))
        responses = await within(asyncio.gather(*requests), 180, "16 requests across the update")
    print(f"\n{engine.stats}")
    assert all(len(r.output_tokens) == 300 for r in responses)
    assert engine.stats.update_cuts >= 1 and keeper.loads == 1, engine.stats
    result = audit(responses, weights)
    assert result.mistagged == 0 and 1 in result.versions, result.examples

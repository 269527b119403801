"""``rollout.weight_transfer: distributed`` against a REAL vLLM server (CPU), Redis and gloo.

The trainer's side is the product's own :class:`VersionPublisher` with a model in hand (in this
process); the rollout worker's side is a :class:`SharedServerFollower`, whose sync owner
has the server receive each version from the trainer. Every generated token is audited against
the weights of its tag (saved to disk by the test for the audit only: the server reads no
checkpoint of a version sent over the wire).

Asserted: versions reach the server over the wire and tag every token; a server that missed
versions catches up from the newest checkpoint, then takes the next version over the wire; a
trainer killed in the middle of a transfer leaves the server labelled ``loading:`` after a
bounded wait, with an error that names the trainer, and the next version gets through; a
server that dies in the middle of a transfer is named in the trainer's report and the other
servers are served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import torch
from transformers import AutoModelForCausalLM

from harness.checkpoints import fresh_server
from harness.configs import make_config
from harness.logprob_audit import LogprobAuditor
from harness.vllm_requests import Lanes
from harness.waits import eventually, stop_task, until, within
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.config import RollstreamConfig
from rollstream.dev.vllm_server import LocalVLLMServer
from rollstream.engines.vllm import VLLMEngine
from rollstream.rollout_workers.weight_sync import SharedServerFollower, WeightSync
from rollstream.state.client import RedisKeys
from rollstream.state.server_lease import ServerLeases
from rollstream.state.version_store import VersionStore
from rollstream.trainer import Checkpoints, VersionPublisher

pytestmark = [pytest.mark.broker, pytest.mark.timeout(300)]

PROMPT = [11, 12, 13, 14, 15]
REPO = Path(__file__).resolve().parents[2]


def config_for(server: LocalVLLMServer, kafka_bootstrap: str, redis_url: str, name: str,
               timeout: float = 20.0, urls: list[str] | None = None) -> RollstreamConfig:
    return make_config(kafka_bootstrap, redis_url, name, {
        "rollout": {"engine": "vllm", "server_urls": urls or [server.url], "model_path": server.model,
                    "weight_transfer": "distributed",
                    "server": {"lease_ttl_seconds": 3.0, "reconcile_seconds": 0.5, "version_poll_seconds": 0.05,
                               "backoff_base_seconds": 0.05, "backoff_max_seconds": 0.5,
                               "health_timeout_seconds": 60}},
        "trainer": {"weight_sender": {"timeout_seconds": timeout}},
    })


class RolloutSide:
    """A rollout worker's engine and its version follower (the sync owner), and lanes of
    48-token requests that keep generating until stopped."""

    def __init__(self, config: RollstreamConfig, redis: aioredis.Redis) -> None:
        rollout = config.rollout
        self.engine = VLLMEngine(rollout.server_urls, rollout.model_path, rollout.server)
        keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
        self.store = VersionStore(redis, keys)
        leases = ServerLeases(redis, keys, "w0", rollout.server.lease_ttl_seconds)
        self.sync = WeightSync([rollout.server_urls[0]], self.engine.admin, leases, rollout.server,
                               checkpoints=self.store.latest_checkpoint)
        self.follower = SharedServerFollower(self.engine, self.store, self.sync, poll_seconds=0.2)
        self.lanes: Lanes | None = None
        self._follower: asyncio.Task[Any] | None = None

    @property
    def owner(self) -> Any:
        return self.sync.candidates[0]

    @property
    def responses(self) -> list[ModelResponse]:
        return self.lanes.responses if self.lanes else []

    def versions(self) -> set[int]:
        return self.lanes.versions() if self.lanes else set()

    async def start(self) -> None:
        await self.engine.start()
        await self.follower.catch_up()  # as the rollout worker does before its first prompt
        self._follower = asyncio.create_task(self.follower.run())
        self.lanes = Lanes(self.engine, 2, lambda lane, n: ModelRequest(
            input_ids=list(PROMPT), gconfig=GenerationHyperparameters(max_new_tokens=48)))

    async def stop(self) -> None:
        if self.lanes is not None:
            await self.lanes.stop()
        if self._follower is not None:
            await stop_task(self._follower, "the version follower")
        await self.engine.close()


@contextlib.asynccontextmanager
async def rollout_side(config: RollstreamConfig, redis: aioredis.Redis) -> AsyncIterator[RolloutSide]:
    side = RolloutSide(config, redis)
    await side.start()
    try:
        yield side
    finally:
        await side.stop()


class Trainer:
    """The tiny model in the trainer's hands: each new version is a perturbation of the last,
    saved to disk only so that the audit can load it."""

    def __init__(self, base: Path, out: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(base)
        self.weights: dict[int, Path] = {0: base}
        self.out = out

    def step(self, version: int) -> None:
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.02)
        self.weights[version] = self.out / f"audit-v{version}"
        self.model.save_pretrained(self.weights[version])

    def audit(self, responses: list[ModelResponse]) -> Any:
        top = max(self.weights)
        checker = LogprobAuditor([self.weights.get(v, self.weights[0]) for v in range(top + 1)])
        for i, resp in enumerate(responses):
            n = len(resp.input_tokens)
            checker.row(resp.input_tokens + resp.output_tokens, [False] * n + [True] * len(resp.output_tokens),
                        [0.0] * n + resp.output_logprobs, [-1] * n + resp.output_versions, f"response {i}")
        return checker.result


async def test_versions_reach_the_server_over_the_wire_and_tag_every_token(
    vllm_server: LocalVLLMServer, kafka_bootstrap: str, redis_url: str, redis_client: aioredis.Redis,
    unique_name: str, tmp_path: Path,
) -> None:
    await fresh_server(vllm_server)
    config = config_for(vllm_server, kafka_bootstrap, redis_url, unique_name)
    trainer = Trainer(Path(vllm_server.model), tmp_path)
    async with rollout_side(config, redis_client) as side, VersionPublisher(config) as publisher:
        await until(lambda: side.owner.lease is not None, "the sync owner")
        for version in (1, 2):
            trainer.step(version)
            await within(publisher.publish(version, model=trainer.model), 60, f"publishing v{version}")
            report = publisher.last_transfer
            assert report is not None and list(report.received) == [vllm_server.url], report
            await until(lambda: version in side.versions(), f"tokens of v{version}", timeout=60)
        assert side.owner.loads == 2 and side.owner.failed_loads == 0
        assert await side.store.latest_checkpoint(2) is None  # no checkpoint: the wire alone
    result = trainer.audit(side.responses)
    print(f"\n{result}; last transfer {report}")
    assert result.mistagged == 0 and {1, 2} <= result.versions, result.examples


async def test_a_server_that_missed_versions_catches_up_from_a_checkpoint_then_takes_the_next(
    vllm_server: LocalVLLMServer, kafka_bootstrap: str, redis_url: str, redis_client: aioredis.Redis,
    unique_name: str, tmp_path: Path,
) -> None:
    await fresh_server(vllm_server)
    config = config_for(vllm_server, kafka_bootstrap, redis_url, unique_name, timeout=2.0)
    trainer = Trainer(Path(vllm_server.model), tmp_path)
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    async with VersionPublisher(config, checkpoints) as publisher:
        # No rollout worker runs: nobody takes v1 (with a checkpoint) or v2 (without).
        trainer.step(1)
        with checkpoints.write(1) as out:
            trainer.model.save_pretrained(out)
        await publisher.publish(1, checkpoints.get(1), model=trainer.model)
        trainer.step(2)
        await publisher.publish(2, model=trainer.model)
        assert publisher.last_transfer is not None and publisher.last_transfer.missed == [vllm_server.url]
        # The server joins now: it loads the newest checkpoint (v1), which is behind the trainer
        # (no worker uses it), then takes v3 over the wire.
        async with rollout_side(config, redis_client) as side:
            async def at_v1() -> bool:
                return (await side.engine.admin.label(vllm_server.url)).version == 1

            await eventually(at_v1, "the server on v1, from its checkpoint", timeout=60)
            trainer.step(3)
            patient = config_for(vllm_server, kafka_bootstrap, redis_url, unique_name, timeout=20.0)
            async with VersionPublisher(patient, checkpoints) as publisher3:
                await within(publisher3.publish(3, model=trainer.model), 60, "publishing v3")
                assert publisher3.last_transfer is not None and publisher3.last_transfer.received
            await until(lambda: 3 in side.versions(), "tokens of v3", timeout=60)
    result = trainer.audit(side.responses)
    print(f"\n{result}")
    assert result.mistagged == 0 and result.versions == {3}, result
    assert side.owner.loads == 2  # v1's checkpoint, v3 over the wire


async def test_a_trainer_killed_mid_transfer_leaves_the_server_loading_and_the_next_version_gets_through(
    vllm_server: LocalVLLMServer, kafka_bootstrap: str, redis_url: str, redis_client: aioredis.Redis,
    unique_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    await fresh_server(vllm_server)
    config = config_for(vllm_server, kafka_bootstrap, redis_url, unique_name, timeout=6.0)
    trainer = Trainer(Path(vllm_server.model), tmp_path)
    caplog.set_level(logging.INFO, logger="rollstream")
    async with rollout_side(config, redis_client) as side:
        await until(lambda: side.owner.lease is not None, "the sync owner")
        dying = subprocess.Popen([sys.executable, "-m", "harness.weight_transfer_peers", "trainer", redis_url,
                                  unique_name, "1"], cwd=REPO, stdout=subprocess.PIPE, text=True)
        # Read off the loop: the owner and the publisher share it and must go on meanwhile.
        address = (await within(asyncio.to_thread(dying.stdout.readline), 90, "the trainer's address")).split()[-1]  # type: ignore[union-attr]
        started = time.monotonic()
        assert await asyncio.to_thread(dying.wait, 60) == -9
        await until(lambda: side.owner.failed_loads >= 1, "the failed transfer", timeout=60)
        waited = time.monotonic() - started
        label = await side.engine.admin.label(vllm_server.url)
        assert label.loading and label.version is None, label
        named = [r.getMessage() for r in caplog.records if address in r.getMessage() and "failed" in r.getMessage()]
        assert named, "no error names the trainer"
        # A new trainer publishes v2: it gets through.
        async with VersionPublisher(config) as publisher:
            trainer.step(2)
            await within(publisher.publish(2, model=trainer.model), 60, "publishing v2")
            assert publisher.last_transfer is not None and publisher.last_transfer.received, publisher.last_transfer
        await until(lambda: 2 in side.versions(), "tokens of v2", timeout=60)
    result = trainer.audit(side.responses)
    print(f"\nthe owner gave up on the dead trainer after {waited:.1f}s: {named[0][:300]}\n{result}")
    assert result.mistagged == 0 and 1 not in result.versions and 2 in result.versions, result


async def test_a_server_killed_mid_transfer_is_named_and_the_others_are_served(
    vllm_server: LocalVLLMServer, kafka_bootstrap: str, redis_url: str, redis_client: aioredis.Redis,
    unique_name: str, tmp_path: Path,
) -> None:
    await fresh_server(vllm_server)
    doomed = "http://doomed.invalid:1"
    config = config_for(vllm_server, kafka_bootstrap, redis_url, unique_name, urls=[vllm_server.url, doomed])
    trainer = Trainer(Path(vllm_server.model), tmp_path)
    async with VersionPublisher(config) as publisher:
        side_config = config_for(vllm_server, kafka_bootstrap, redis_url, unique_name)
        async with rollout_side(side_config, redis_client) as side:
            await until(lambda: side.owner.lease is not None, "the sync owner")
            trainer.step(1)
            publishing = asyncio.create_task(publisher.publish(1, model=trainer.model))
            assert publisher.sender is not None
            await until(lambda: publisher.sender._session is not None, "the transfer open")  # type: ignore[union-attr]
            peer = subprocess.Popen([sys.executable, "-m", "harness.weight_transfer_peers", "server",
                                     publisher.sender.address, "1", doomed], cwd=REPO, stdout=subprocess.PIPE,
                                    text=True)
            try:
                # Off the loop: the publisher on it must go on to create the peer's group meanwhile.
                joined = await within(asyncio.to_thread(peer.stdout.readline), 90, "the doomed peer joining")  # type: ignore[union-attr]
                assert joined.strip() == "joined"
            finally:
                peer.kill()
                peer.wait()
            await within(publishing, 60, "the publish of v1")
            report = publisher.last_transfer
            await until(lambda: 1 in side.versions(), "tokens of v1", timeout=60)
    print(f"\n{report}")
    assert report is not None and list(report.received) == [vllm_server.url], report
    assert list(report.failed) == [doomed] and not report.missed, report
    assert trainer.audit(side.responses).mistagged == 0

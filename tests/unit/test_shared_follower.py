"""The follower of shared SGLang servers declares versions and never touches the servers itself;
the engine factory picks it for SGLang engines only."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from harness.fakes import FakeSource, RecordingEngine, until_true
from rollstream.api.engine import WeightUpdate
from rollstream.config import RolloutConfig, ServerConfig
from rollstream.engines.sglang import SGLangEngine
from rollstream.rollout_workers.engine_factory import build_follower
from rollstream.rollout_workers.version_follower import VersionFollower
from rollstream.rollout_workers.weight_sync import SharedServerFollower, WeightSync
from rollstream.state.client import RedisKeys
from rollstream.state.server_lease import ServerLeases


URLS = ["http://gpu0:30000", "http://gpu1:30000/"]


def sync_for(urls: list[str]) -> WeightSync:
    engine = SGLangEngine(urls)
    leases = ServerLeases(aioredis.from_url("redis://127.0.0.1:1/0"), RedisKeys("e", "t"), "w", 10.0)
    return WeightSync(urls, engine.admin, leases, ServerConfig())


async def test_catch_up_and_new_versions_are_declared_not_loaded() -> None:
    engine, source, sync = RecordingEngine(), FakeSource(), sync_for(URLS)
    source.publish(4, "/ckpt/v4")
    follower = SharedServerFollower(engine, source, sync, poll_seconds=0.05)
    assert await follower.catch_up() == 4 and engine.get_version() == 4
    assert [o._target for o in sync.candidates] == [WeightUpdate(4, "/ckpt/v4")] * 2
    task = asyncio.create_task(super(SharedServerFollower, follower).run())  # the follow half only
    source.publish(5, None)  # no weights: not declared (no server could ever reach it)
    await asyncio.sleep(0.3)
    assert engine.get_version() == 4
    source.publish(6, "/ckpt/v6")
    await until_true(lambda: engine.get_version() == 6)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert engine.calls == []  # never paused, loaded or resumed anything
    assert [o.url for o in sync.candidates] == ["http://gpu0:30000", "http://gpu1:30000"]
    assert all(o._target == WeightUpdate(6, "/ckpt/v6") for o in sync.candidates)


def test_factory_picks_the_follower_by_engine() -> None:
    redis = aioredis.from_url("redis://127.0.0.1:1/0")  # never contacted here
    keys = RedisKeys("e", "t")
    config = RolloutConfig(engine="sglang", server_urls=URLS, tokenizer_path="/tok",
                           server=ServerConfig(lease_ttl_seconds=4.0))
    shared = build_follower(config, SGLangEngine(URLS, settings=config.server), FakeSource(), redis, keys, "w7")
    assert isinstance(shared, SharedServerFollower) and len(shared.sync.candidates) == 2
    leases = shared.sync.candidates[0]._leases
    assert leases.owner.startswith("w7:") and leases.ttl_seconds == 4.0
    own = build_follower(RolloutConfig(), RecordingEngine(), FakeSource(), redis, keys, "w7")
    assert type(own) is VersionFollower

"""Three rollout workers share two SGLang stand-ins while a trainer publishes a version a second.

The workers are the production tier (``rollstream.rollout_workers.service.run``, in-process, the real
broker and Redis); their engine factory returns the production ``SGLangEngine`` and keeps a
reference so the test can see which servers each worker used. For 30 s a trainer-like task
publishes a new version every second; the stand-ins record which weights produced every token.

Asserted: every prompt's samples arrive as episodes; 0 mis-tagged (and 0 unknown) tokens among
all generated tokens; each server loaded each version exactly once (versions are published once
both servers have an owner) and ended on the newest; no request was refused as a duplicate; each server was used by at least two workers; some sequences span versions (the
abort/resume path ran).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from harness.fake_sglang import FakeSGLangServer
from harness.ledger_audit import audit
from harness.shared_sglang import (
    ENGINES,
    PromptFeed,
    loads_per_version,
    owners_elected,
    publish_versions,
    samples,
    shared_config,
    worker_settings,
)
from harness.waits import within
from rollstream.kafka.admin import ensure_topics
from rollstream.rollout_workers.service import run
from rollstream.wire import Episode
from rollstream.kafka.topics import TopicNames


pytestmark = [pytest.mark.broker, pytest.mark.timeout(300)]

VERSIONS = range(1, 31)  # one a second: 30 s
WORKERS = ("w0", "w1", "w2")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollstream.tiny.text_model import build_tiny_model, default_corpus

    return build_tiny_model(tmp_path_factory.mktemp("shared-sglang") / "tiny", default_corpus(),
                            vocab_size=300, hidden_size=32, num_layers=2, num_heads=4)


async def test_three_workers_two_shared_servers_exact_tags(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model: Path
) -> None:
    async with FakeSGLangServer(vocab_size=300, token_delay=0.01, load_delay=0.05) as a, \
            FakeSGLangServer(vocab_size=300, token_delay=0.01, load_delay=0.05) as b:
        configs = [shared_config(kafka_bootstrap, redis_url, unique_name, {
            **worker_settings([a, b], tiny_model, worker_id),
            "engine": "custom", "engine_factory": "harness.shared_sglang:make_engine",
        }) for worker_id in WORKERS]
        await ensure_topics(configs[0].kafka, TopicNames.of(configs[0]))
        stop = asyncio.Event()
        workers = [asyncio.create_task(run(config, stop), name=config.rollout.worker_id) for config in configs]
        feed = PromptFeed(configs[0])
        feeding = asyncio.create_task(feed.run())
        try:
            await owners_elected(configs[0], [a, b])
            await within(publish_versions(configs[0], VERSIONS, every=1.0), 120, "publishing the versions")
            feed.stop()
            await within(feeding, 30, "the prompt feed stopping")
            found, published = await samples(configs[0], feed.wanted)
            assert not any(w.done() for w in workers), [w.exception() for w in workers if w.done()]
        finally:
            feed.stop()
            stop.set()
            await within(asyncio.gather(*workers, return_exceptions=True), 60, "the rollout workers stopping")
            await within(asyncio.gather(feeding, return_exceptions=True), 30, "the prompt feed stopping")

        episodes = [m for m in found.values() if isinstance(m, Episode)]
        assert len(episodes) == len(found), [m for m in found.values() if not isinstance(m, Episode)][:3]
        result = audit(published, [a, b])
        print(f"\n{len(feed.wanted) // 2} prompts; {result}")
        assert result.mistagged == 0 and result.unknown == 0, result.examples
        assert result.tokens >= 1000 and result.multi_version_episodes > 0

        newest = VERSIONS[-1]
        for server in (a, b):
            loads = loads_per_version(server)
            skipped = [v for v in VERSIONS if v not in loads]
            print(f"{server.url}: {len(server.loads)} loads of {len(VERSIONS)} versions, skipped {skipped}, "
                  f"pauses {server.hits['pause']}, refusals {dict(server.refusals)}")
            # Owners skip a version only when a newer one was already out before they got to it;
            # with a load taking ~0.1 s and a version a second, none is skipped.
            assert loads == {v: 1 for v in VERSIONS}, (loads, skipped)
            assert server.refusals["duplicate_rid"] == 0 and server.version == newest
            users = [w for w in WORKERS if ENGINES[w].stats.calls_per_server[server.url] > 0]
            assert len(users) >= 2, users
            assert len(set(server.requests[i]["rid"] for i in range(len(server.requests)))) == len(server.requests)

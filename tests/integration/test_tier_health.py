"""A real tier process answers its health probes: live at once, ready only once it consumes
(not while it waits for an unreachable Kafka), and its metrics beside them, where the rollout
worker's include what its workflows recorded in ``stats_tracker``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka.structs import TopicPartition

from harness.configs import pipeline_config, write_config
from harness.services import free_port
from harness.tiers import TierProcess, probe
from rollstream.config import config_from_dict
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_consumer, make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.wire import Episode, PromptTask, decode_episode, encode


pytestmark = [pytest.mark.broker, pytest.mark.timeout(180)]


def served_config(tmp_path: Path, bootstrap: str, redis_url: str, name: str, port: int,
                  **sections: Any) -> Path:
    """A tier config whose probes and metrics are served on ``port``."""
    return write_config(tmp_path / f"{name}.yaml", pipeline_config(
        bootstrap, redis_url, name, grouping={"instance_id": "g0", "session_timeout_ms": 6000},
        metrics={"port": port}, **sections))


def test_a_tier_waiting_for_kafka_is_live_but_not_ready(tmp_path: Path, redis_url: str, unique_name: str) -> None:
    port = free_port()
    config = served_config(tmp_path, f"127.0.0.1:{free_port()}", redis_url, unique_name, port)  # nobody there
    tier = TierProcess("grouping", config, tmp_path / f"{unique_name}.log").start()
    try:
        assert tier.wait_probe(port, "/livez") == "ok\n"
        time.sleep(2)  # it keeps trying to reach Kafka
        assert probe(port, "/readyz") == (503, "starting\n")
    finally:
        tier.kill()  # a tier still waiting for Kafka at start finishes that wait before a SIGTERM


def test_a_consuming_tier_is_ready_and_serves_its_metrics(tmp_path: Path, kafka_bootstrap: str, redis_url: str,
                                                          unique_name: str) -> None:
    port = free_port()
    tier = TierProcess("grouping", served_config(tmp_path, kafka_bootstrap, redis_url, unique_name, port),
                       tmp_path / f"{unique_name}.log").start()
    try:
        assert tier.wait_probe(port, "/readyz") == "ok\n"
        assert probe(port, "/livez") == (200, "ok\n")
        metrics = probe(port, "/metrics")
        assert metrics is not None and metrics[0] == 200 and "rollstream_open_groups" in metrics[1]
    finally:
        assert tier.stop() == 0, tier.tail()


def workflow_stat(metrics: str, key: str) -> tuple[float, float]:
    """``(count, sum)`` of ``rollstream_workflow_stat{key=...}`` in a scrape (0, 0 when absent)."""
    found = {"count": 0.0, "sum": 0.0}
    for line in metrics.splitlines():
        for part in found:
            prefix = f'rollstream_workflow_stat_{part}{{key="{key}"}} '
            if line.startswith(prefix):
                found[part] = float(line[len(prefix):])
    return found["count"], found["sum"]


async def read_episodes(tree: dict[str, Any], topic: str, count: int, tier: TierProcess) -> list[Episode]:
    consumer = make_consumer(config_from_dict(tree).kafka, "test-reader", group_id=None)
    await consumer.start()
    episodes: list[Episode] = []
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(2)])
        await consumer.seek_to_beginning()
        deadline = time.monotonic() + 120
        while len(episodes) < count:
            assert tier.running() and time.monotonic() < deadline, f"{len(episodes)} of {count} episodes:\n{tier.tail()}"
            for records in (await consumer.getmany(timeout_ms=500)).values():
                episodes += [m for m in map(decode_episode, (r.value for r in records)) if isinstance(m, Episode)]
    finally:
        await consumer.stop()
    return episodes


@pytest.mark.timeout(300)
async def test_workflow_statistics_reach_the_rollout_workers_metrics(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str, unique_name: str, tiny_model_dir: Path,
) -> None:
    """The built-in RLVR workflow records each episode's ``seqlen`` (prompt + generated
    tokens): the scrape counts one per sample, and their sum is the samples' lengths."""
    port = free_port()
    rollout = {"model_path": str(tiny_model_dir), "seed": 0, "worker_id": "w-stats", "max_concurrent_rollouts": 4,
               "commit_interval_seconds": 0.2, "gconfig": {"max_new_tokens": 6}}
    tree = pipeline_config(kafka_bootstrap, redis_url, unique_name)
    names = TopicNames(unique_name, "t0")
    await ensure_topics(config_from_dict(tree).kafka, names)
    config = served_config(tmp_path, kafka_bootstrap, redis_url, unique_name, port, rollout=rollout)
    tier = TierProcess("rollout-worker", config, tmp_path / f"{unique_name}.log").start()
    try:
        tier.wait_probe(port, "/readyz", timeout=120)
        metrics = probe(port, "/metrics")
        assert metrics is not None and workflow_stat(metrics[1], "rollout/seqlen") == (0, 0)
        producer = make_producer(config_from_dict(tree).kafka, "test-prompts")
        await producer.start()
        try:
            for i in range(2):
                prompt = PromptTask(task_id=f"s:0:{i}", group_size=2, data={"prompt": f"{i}+{i}="})
                await producer.send_and_wait(names.prompts, encode(prompt), key=prompt.task_id.encode())
        finally:
            await producer.stop()
        episodes = await read_episodes(tree, names.episodes, 4, tier)
        metrics = probe(port, "/metrics")
        assert metrics is not None and metrics[0] == 200
        lengths = sum(e.trajectory["input_ids"].shape[1] for e in episodes)
        assert workflow_stat(metrics[1], "rollout/seqlen") == (4, lengths), metrics[1][-2000:]
        assert "# TYPE rollstream_workflow_stat summary" in metrics[1]
    finally:
        assert tier.stop() == 0, tier.tail()


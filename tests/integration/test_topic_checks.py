"""Topic checks against a real broker: a tier refuses topics that break co-partitioning before
it consumes anything, and ``rollstream topics create`` grows what may grow and refuses the rest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml
from aiokafka import TopicPartition
from aiokafka.admin import NewTopic
from aiokafka.errors import GroupCoordinatorNotAvailableError

from harness.configs import make_config
from harness.episodes import scored
from rollstream.config import RollstreamConfig
from rollstream.kafka.admin import describe_topics, ensure_topics
from rollstream.kafka.clients import make_admin, make_consumer, make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.retry import RetryPolicy
from rollstream.wire import encode


pytestmark = [pytest.mark.broker, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]



async def create(config: RollstreamConfig, counts: dict[str, int]) -> None:
    admin = make_admin(config.kafka, "test")
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, n, 1) for name, n in counts.items()])
    finally:
        await admin.close()


async def partition_counts(config: RollstreamConfig) -> dict[str, int]:
    names = TopicNames.of(config)
    admin = make_admin(config.kafka, "test")
    await admin.start()
    try:
        states = await describe_topics(admin, [*names.data_topics(), *names.compacted_topics()])
    finally:
        await admin.close()
    return {name.rsplit(".", 1)[-1]: s.partitions for name, s in states.items()}


def cli(config_file: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollstream.cli", *args, "--config", str(config_file)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)


def write_config(tmp_path: Path, config: RollstreamConfig, partitions: int) -> Path:
    kafka = {"bootstrap_servers": config.kafka.bootstrap_servers, "partitions": partitions}
    if config.kafka.prompt_partitions is not None:
        kafka["prompt_partitions"] = config.kafka.prompt_partitions
    tree = {"kafka": kafka,
            "redis": {"url": config.redis.url},
            "experiment": {"experiment_name": config.experiment.experiment_name, "trial_name": "t0"},
            "grouping": {"instance_id": "g0", "session_timeout_ms": 6000}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


async def test_grouping_refuses_scored_with_other_partitions_and_consumes_nothing(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    config = make_config(kafka_bootstrap, redis_url, unique_name)
    names = TopicNames.of(config)
    await create(config, {names.scored: 3})  # as someone's hand-made topic might be
    producer = make_producer(config.kafka, "test-writer")
    await producer.start()
    try:  # a complete group waits on scored: a grouping tier that ran would emit it
        for sample in range(4):
            await producer.send_and_wait(names.scored, encode(scored("task-1", sample, 4)), key=b"task-1")
    finally:
        await producer.stop()
    done = cli(write_config(tmp_path, config, 2), "grouping")
    assert done.returncode == 1, done.stderr
    assert "co-partitioned differ in partition count" in done.stderr
    assert f"{names.scored} has 3" in done.stderr and f"{names.episodes} has 2" in done.stderr
    assert "rollstream topics create --set kafka.partitions=3" in done.stderr
    # nothing consumed: no committed offsets for the grouping group, nothing on batches
    admin = make_admin(config.kafka, "test")
    await admin.start()
    try:  # the offsets topic may be created by this very request on a fresh broker: retried
        offsets = await RetryPolicy(initial=0.5, maximum=2.0, max_attempts=20).call(
            lambda: admin.list_consumer_group_offsets(
                names.group_id("grouping"), partitions=[TopicPartition(names.scored, p) for p in range(3)]),
            retry_on=(GroupCoordinatorNotAvailableError,), what="reading the grouping group's offsets",
        )
    finally:
        await admin.close()
    assert all(meta is None or meta.offset < 0 for meta in offsets.values()), offsets
    reader = make_consumer(config.kafka, "test-reader", group_id=None)
    await reader.start()
    try:
        tps = [TopicPartition(names.batches, p) for p in range(2)]
        assert sum((await reader.end_offsets(tps)).values()) == 0
    finally:
        await reader.stop()


async def test_topics_create_grows_every_data_topic_together_and_refuses_shrinking(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    config = make_config(kafka_bootstrap, redis_url, unique_name)
    await ensure_topics(config.kafka, TopicNames.of(config))  # 2 partitions each
    done = cli(write_config(tmp_path, config, 3), "topics", "create")
    assert done.returncode == 0, done.stderr
    counts = await partition_counts(config)
    assert counts == {"prompts": 3, "episodes": 3, "scored": 3, "batches": 3, "dead-letter": 3,
                      "grouping-changelog": 3, "producer-cursor": 2}, counts
    assert f"grew {TopicNames.of(config).scored}: 2 -> 3 partitions" in done.stdout
    shrink = cli(write_config(tmp_path, config, 2), "topics", "create")
    assert shrink.returncode == 1
    assert "partitions can only grow" in shrink.stderr and "Set kafka.partitions to 3 or more" in shrink.stderr
    assert (await partition_counts(config))["scored"] == 3


async def test_topics_create_refuses_to_grow_a_trial_with_records_in_flight(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    config = make_config(kafka_bootstrap, redis_url, unique_name)
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    producer = make_producer(config.kafka, "test-writer")
    await producer.start()
    try:  # two prompts no rollout worker has taken yet
        for key in (b"a", b"b"):
            await producer.send_and_wait(names.prompts, b"not read by anyone yet", key=key)
    finally:
        await producer.stop()
    done = cli(write_config(tmp_path, config, 4), "topics", "create")
    assert done.returncode == 1
    assert "not drained" in done.stderr and "rollout-worker 2" in done.stderr
    assert (await partition_counts(config))["prompts"] == 2
    # the prompts topic alone grows while records are in flight (kafka.prompt_partitions)
    more_prompts = msgspec.structs.replace(config, kafka=msgspec.structs.replace(config.kafka, prompt_partitions=5))
    done = cli(write_config(tmp_path, more_prompts, 2), "topics", "create")
    assert done.returncode == 0, done.stderr
    assert f"grew {names.prompts}: 2 -> 5 partitions" in done.stdout
    counts = await partition_counts(config)
    assert counts["prompts"] == 5 and counts["episodes"] == 2, counts


async def test_creating_topics_waits_for_enough_brokers_and_says_why(
    kafka_bootstrap: str, redis_url: str, unique_name: str, dev_stack: object
) -> None:
    config = make_config(kafka_bootstrap, redis_url, unique_name)
    admin = make_admin(config.kafka, "test")
    await admin.start()
    try:
        brokers = len((await admin.describe_cluster())["brokers"])
    finally:
        await admin.close()
    wanted = brokers + 1
    kafka = config.kafka.__class__(**{**_fields(config.kafka), "replication_factor": wanted})
    with pytest.raises(Exception, match=rf"not ready after 3s .*kafka.replication_factor={wanted} needs {wanted} brokers"):
        await ensure_topics(kafka, TopicNames.of(config), wait_seconds=3)


def _fields(struct: object) -> dict[str, object]:
    return {name: getattr(struct, name) for name in struct.__struct_fields__}  # type: ignore[attr-defined]

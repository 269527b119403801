"""Security settings end to end: Kafka SCRAM through our client factories, Redis AUTH, no secrets in logs.

Kafka: a second local broker with a SASL_PLAINTEXT listener (SCRAM-SHA-256 and -512 users).
Every client is built by ``rollstream.kafka.clients`` from a ``RollstreamConfig``; the producer
tier runs through it end to end. Redis: a local redis-server with ``requirepass`` and an ACL user.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import yaml
from aiokafka.errors import KafkaConnectionError
from redis.asyncio.connection import SSLConnection
from redis.exceptions import AuthenticationError, ResponseError

from harness.ledger import read_topic
from rollstream.config import RedisConfig, RollstreamConfig, config_from_dict
from rollstream.dev.broker import LocalKafkaBroker
from rollstream.dev.launcher import DevStack
from rollstream.dev.redis_server import LocalRedisServer
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import KafkaAuthenticationError, make_consumer, make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.producers.service import run_producer
from rollstream.state.budget import RebuiltCounts, StalenessBudget
from rollstream.state.client import RedisKeys, connect
from rollstream.wire import PromptTask, decode_prompt, encode


pytestmark = [pytest.mark.broker, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
KAFKA_USER, KAFKA_PASSWORD = "rollstream-app", "kafka-Pa55word-7f3e"
REDIS_PASSWORD = "redis-Pa55word-91ab"
ACL_USER, ACL_PASSWORD = "rs-worker", "acl-Pa55word-c0de"


@pytest.fixture(scope="module")
def scram_broker(dev_stack: DevStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafkaBroker]:
    if dev_stack.broker is None:
        pytest.skip("the services are external: the local broker harness is not in use")
    broker = LocalKafkaBroker(tmp_path_factory.mktemp("scram"), heap="256m",
                              sasl_scram_users={KAFKA_USER: KAFKA_PASSWORD})
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisServer]:
    with LocalRedisServer(tmp_path_factory.mktemp("redis-auth"), password=REDIS_PASSWORD) as server:
        yield server


def sasl_config(broker: LocalKafkaBroker, name: str, mechanism: str, password: str = KAFKA_PASSWORD,
                **sections: Any) -> RollstreamConfig:
    assert broker.sasl_bootstrap is not None
    tree: dict[str, Any] = {
        "kafka": {"bootstrap_servers": broker.sasl_bootstrap, "security_protocol": "SASL_PLAINTEXT",
                  "sasl_mechanism": mechanism, "sasl_username": KAFKA_USER, "sasl_password": password,
                  "partitions": 1, "transaction_timeout_ms": 10000, "request_timeout_ms": 10000},
        "experiment": {"experiment_name": name, "trial_name": mechanism.lower()},
    }
    tree.update(sections)
    return config_from_dict(tree)


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
async def test_scram_clients_from_config(scram_broker: LocalKafkaBroker, unique_name: str, mechanism: str) -> None:
    config = sasl_config(scram_broker, unique_name, mechanism)
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)  # the admin client authenticates too
    producer = make_producer(config.kafka, "sasl-test", transactional_id=f"{unique_name}-{mechanism}")
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send(names.prompts, encode(PromptTask(task_id="t-1", group_size=1, data={})), key=b"t-1")
    finally:
        await producer.stop()
    consumer = make_consumer(config.kafka, "sasl-test", names.prompts, group_id=f"{unique_name}-readers")
    await consumer.start()
    try:
        record = await asyncio.wait_for(consumer.getone(), 30)
        await consumer.commit()  # the group coordinator path authenticates as well
    finally:
        await consumer.stop()
    assert decode_prompt(record.value).task_id == "t-1"


async def test_wrong_scram_password_is_refused_clearly(scram_broker: LocalKafkaBroker, unique_name: str) -> None:
    config = sasl_config(scram_broker, unique_name, "SCRAM-SHA-512", password="not-the-password")
    with pytest.raises(KafkaAuthenticationError) as refused:
        await asyncio.wait_for(ensure_topics(config.kafka, TopicNames(unique_name, "t")), 30)
    message = str(refused.value)
    assert "SaslAuthenticationFailed" in message and KAFKA_USER in message and "kafka.sasl_password" in message
    assert "not-the-password" not in message
    producer = make_producer(config.kafka, "sasl-wrong")
    with pytest.raises(KafkaConnectionError):
        await producer.start()
    await producer.stop()


async def test_producer_tier_over_scram(scram_broker: LocalKafkaBroker, unique_name: str, redis_url: str,
                                        tmp_path: Path) -> None:
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(3)))
    config = sasl_config(scram_broker, unique_name, "SCRAM-SHA-256", redis={"url": redis_url},
                         producer={"dataset": str(dataset), "group_size": 2},
                         staleness={"groups_per_step": 100})
    summary = await asyncio.wait_for(run_producer(config, asyncio.Event()), 90)
    names = TopicNames.of(config)
    prompts = await read_topic(config.kafka, names.prompts, decode_prompt)
    assert summary.published == 3 and sorted(p.task_id for p in prompts) == [f"producer-0:0:{i}" for i in range(3)]


@pytest_asyncio.fixture
async def acl_user(auth_redis: LocalRedisServer) -> AsyncIterator[str]:
    admin = aioredis.from_url(auth_redis.url)
    await admin.execute_command("ACL", "SETUSER", ACL_USER, "reset", "on", f">{ACL_PASSWORD}", "~*", "&*", "+@all")
    try:
        yield ACL_USER
    finally:
        await admin.execute_command("ACL", "DELUSER", ACL_USER)
        await admin.aclose()


def plain_url(server: LocalRedisServer) -> str:
    return f"redis://127.0.0.1:{server.port}/0"


async def answers(config: RedisConfig) -> bool:
    client = connect(config)
    try:
        return bool(await client.ping())
    finally:
        await client.aclose()


async def test_redis_auth_password_in_url_or_settings(auth_redis: LocalRedisServer, unique_name: str) -> None:
    assert await answers(RedisConfig(url=auth_redis.url))  # redis://:PASSWORD@host:port/0
    assert await answers(RedisConfig(url=plain_url(auth_redis), password=REDIS_PASSWORD))
    for bad in (RedisConfig(url=plain_url(auth_redis), password="wrong"),
                RedisConfig(url=f"redis://:{quote('wrong')}@127.0.0.1:{auth_redis.port}/0")):
        with pytest.raises(AuthenticationError):
            await answers(bad)
    with pytest.raises((AuthenticationError, ResponseError), match="(?i)auth"):
        await answers(RedisConfig(url=plain_url(auth_redis)))  # no password at all


async def test_redis_acl_user(auth_redis: LocalRedisServer, acl_user: str, unique_name: str) -> None:
    config = RedisConfig(url=plain_url(auth_redis), username=acl_user, password=ACL_PASSWORD)
    client = connect(config)
    try:  # the Lua scripts of the staleness budget run as the ACL user
        budget = StalenessBudget(client, RedisKeys(unique_name, "t0"), 0, 2)
        assert await budget.restore(RebuiltCounts())  # what a producer does first (rebuilt from the topics)
        generation = await budget.generation()
        assert await budget.try_admit("task-1", generation) and (await budget.usage())["admitted"] == 1
        assert await budget.release("task-1", "timeout") and (await budget.usage())["dropped"] == 1
    finally:
        await client.aclose()
    with pytest.raises(AuthenticationError):
        await answers(RedisConfig(url=plain_url(auth_redis), username=acl_user, password="wrong"))


def test_rediss_url_builds_a_tls_client() -> None:
    client = connect(RedisConfig(url=f"rediss://:{REDIS_PASSWORD}@redis.example:6380/2", username="u"))
    pool = client.connection_pool
    assert pool.connection_class is SSLConnection
    assert pool.connection_kwargs["password"] == REDIS_PASSWORD and pool.connection_kwargs["username"] == "u"
    assert pool.connection_kwargs["db"] == 2 and pool.connection_kwargs["port"] == 6380


async def test_secrets_never_reach_the_logs(scram_broker: LocalKafkaBroker, auth_redis: LocalRedisServer,
                                            unique_name: str, tmp_path: Path) -> None:
    """A producer tier with every secret configured, run twice: once fine, once with a wrong
    Kafka password (so the failure path logs too); its stderr never shows a secret."""
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(json.dumps({"prompt": "q"}) + "\n")
    tree = {
        "kafka": {"bootstrap_servers": scram_broker.sasl_bootstrap, "security_protocol": "SASL_PLAINTEXT",
                  "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": KAFKA_USER, "sasl_password": KAFKA_PASSWORD,
                  "partitions": 1, "request_timeout_ms": 10000},
        "redis": {"url": auth_redis.url, "password": REDIS_PASSWORD},
        "experiment": {"experiment_name": unique_name, "trial_name": "logs"},
        "producer": {"dataset": str(dataset), "group_size": 1},
        "staleness": {"groups_per_step": 10},
    }
    config_file = tmp_path / "tier.yaml"
    config_file.write_text(yaml.safe_dump(tree))
    secrets = [KAFKA_PASSWORD, REDIS_PASSWORD, quote(REDIS_PASSWORD, safe="")]
    runs = {}
    for label, extra in (("ok", []), ("wrong", ["--set", "kafka.sasl_password=Wrong-Pa55-for-logs"])):
        result = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "rollstream.cli", "producer", "--config", str(config_file), *extra],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )
        runs[label] = result
        for secret in secrets + (["Wrong-Pa55-for-logs"] if extra else []):
            assert secret not in result.stderr and secret not in result.stdout, f"{label}: {secret} leaked"
    assert runs["ok"].returncode == 0, runs["ok"].stderr[-2000:]
    assert "'sasl_password': '***'" in runs["ok"].stderr  # the config is logged, redacted
    assert runs["wrong"].returncode == 1 and "KafkaAuthenticationError" in runs["wrong"].stderr

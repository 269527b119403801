"""compose's replicated Kafka (``--env-file deploy/kafka3.env --profile kafka3``) and the tiers'
health checks, offline.

The three nodes are checked as compose would configure them (the env file interpolated), the
nodes' start guard and the tiers' health check commands are run as written (compose's ``$$``
made ``$``): the guard with a stand-in for the image's start script, the health checks against
a real ``rollstream.runtime.health`` server.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.compose import NODES, ROOT, kafka3, load_compose, rollstream_services
from harness.health_server import serving
from rollstream.config import load_config
from rollstream.runtime.health import Health


pytestmark = pytest.mark.timeout(120)

TIERS = ("producer", "rollout-worker", "rollout-worker-cpu", "reward-worker", "grouping", "dump")


def test_three_nodes_are_three_controller_voters_with_one_cluster_id() -> None:
    services = kafka3()["services"]
    voters = {f"{s['environment']['KAFKA_NODE_ID']}@{s['hostname']}:9093" for s in (services[n] for n in NODES)}
    for name in NODES:
        env = services[name]["environment"]
        assert env["KAFKA_PROCESS_ROLES"] == "broker,controller", name
        assert set(env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")) == voters, name
        assert "CONTROLLER://:9093" in env["KAFKA_LISTENERS"], name
        assert "depends_on" not in services[name], f"{name}: a voter alone cannot become healthy"
    ids = {services[n]["environment"]["CLUSTER_ID"] for n in NODES}
    assert len(ids) == 1
    raw = base64.urlsafe_b64decode(ids.pop() + "==")  # what kafka-storage random-uuid prints
    assert len(raw) == 16


def test_every_node_has_its_own_published_external_listener() -> None:
    services = kafka3()["services"]
    published = set()
    for name in NODES:
        node = services[name]
        advertised = dict(item.split("://") for item in node["environment"]["KAFKA_ADVERTISED_LISTENERS"].split(","))
        assert advertised["PLAINTEXT"] == f"{node['hostname']}:9092"
        host_port = advertised["EXTERNAL"].rsplit(":", 1)[1]
        assert node["ports"] == [f"0.0.0.0:{host_port}:9094"], name  # published where it is advertised
        published.add(host_port)
    assert len(published) == 3


def test_replication_three_and_min_isr_two_reach_brokers_and_tiers() -> None:
    compose = kafka3()
    for name in NODES:
        env = compose["services"][name]["environment"]
        assert env["KAFKA_DEFAULT_REPLICATION_FACTOR"] == "3" and env["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
        assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "3"
        assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "3"
        assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "2"
        assert env["KAFKA_UNCLEAN_LEADER_ELECTION_ENABLE"] == "false"
    for name, service in rollstream_services(compose).items():
        environ = {k: str(v) for k, v in service["environment"].items()}
        config = load_config(ROOT / "deploy" / "rollstream.yaml", environ=environ)
        assert config.kafka.replication_factor == 3 and config.kafka.min_insync_replicas == 2, name
        assert config.kafka.bootstrap_servers.split(",") == ["kafka:9092", "kafka-2:9092", "kafka-3:9092"], name


def test_the_topics_job_does_not_rely_on_restarts() -> None:
    topics = kafka3()["services"]["topics"]
    assert topics["restart"] == "no"
    assert topics["depends_on"]["kafka"]["condition"] == "service_healthy"


def run_guard(service: dict, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The node's command with the image's start script replaced by one that says it ran."""
    script = tmp_path / "run"
    script.write_text("#!/bin/sh\necho started\n")
    script.chmod(0o755)
    command = [part.replace("$$", "$").replace("/etc/kafka/docker/run", str(script)) for part in service["command"]]
    env = {**{k: str(v) for k, v in service["environment"].items()}, "PATH": os.environ["PATH"]}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=30, check=False)


def test_a_node_outside_the_voters_refuses_to_start_and_says_how(tmp_path: Path) -> None:
    without_env_file = load_compose()["services"]
    refused = run_guard(without_env_file["kafka-2"], tmp_path)
    assert refused.returncode == 1 and "--env-file deploy/kafka3.env" in refused.stderr
    assert run_guard(without_env_file["kafka"], tmp_path).stdout == "started\n"  # one node alone
    for name in NODES:
        assert run_guard(kafka3()["services"][name], tmp_path).stdout == "started\n", name


@pytest.fixture
def health_server() -> Iterator[tuple[Health, int]]:
    health = Health()
    with serving(health) as port:
        yield health, port


def run_check(service: dict, port: int) -> int:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python"
    env = {**os.environ, "ROLLSTREAM__METRICS__PORT": str(port)}
    return subprocess.run([sys.executable, *test[2:]], env=env, capture_output=True, timeout=30, check=False).returncode


def test_tier_health_checks_follow_readiness(health_server: tuple[Health, int]) -> None:
    health, port = health_server
    services = load_compose()["services"]
    for name in TIERS:
        assert services[name]["environment"]["ROLLSTREAM__METRICS__PORT"] == "9100", name
        assert run_check(services[name], port) != 0, f"{name} healthy before it is ready"
    health.mark_ready()
    for name in TIERS:
        assert run_check(services[name], port) == 0, name
    health.mark_not_ready("stopping")
    assert run_check(services["grouping"], port) != 0
    assert run_check(services["trainer"], port) == 0  # the trainer's check asks /livez


def test_one_shot_jobs_have_no_health_check() -> None:
    services = load_compose()["services"]
    assert "healthcheck" not in services["topics"] and "healthcheck" not in services["demo-assets"]

"""The local replicated cluster's configuration (no JVM started): every node a voter, one
cluster id, replication 3 and min ISR 2 for new and internal topics; one node stays as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.dev.broker import LocalKafkaBroker
from rollstream.dev.cluster import LocalKafkaCluster
from rollstream.dev.launcher import Services, export_lines


def test_three_nodes_are_three_voters_of_one_cluster(tmp_path: Path) -> None:
    cluster = LocalKafkaCluster(tmp_path, brokers=3)
    props = {i: node.server_properties() for i, node in cluster.nodes.items()}
    voters = {p["controller.quorum.voters"] for p in props.values()}
    assert len(voters) == 1
    named = dict(v.split("@") for v in voters.pop().split(","))
    assert named == {str(i): f"127.0.0.1:{node.controller_port}" for i, node in cluster.nodes.items()}
    assert [p["node.id"] for p in props.values()] == ["1", "2", "3"]
    assert len({node.layout.cluster_id for node in cluster.nodes.values()}) == 1  # type: ignore[union-attr]
    assert len({node.port for node in cluster.nodes.values()}) == 3
    assert cluster.bootstrap.split(",") == [node.bootstrap for node in cluster.nodes.values()]
    for p in props.values():
        assert p["process.roles"] == "broker,controller"
        assert p["default.replication.factor"] == p["offsets.topic.replication.factor"] == "3"
        assert p["transaction.state.log.replication.factor"] == "3"
        assert p["min.insync.replicas"] == p["transaction.state.log.min.isr"] == "2"
        assert p["unclean.leader.election.enable"] == "false"


def test_smaller_clusters_replicate_as_far_as_they_can(tmp_path: Path) -> None:
    two = LocalKafkaCluster(tmp_path / "two", brokers=2)
    assert (two.replication, two.min_insync) == (2, 1)
    five = LocalKafkaCluster(tmp_path / "five", brokers=5)
    assert (five.replication, five.min_insync) == (3, 2)
    with pytest.raises(ValueError, match="at least one broker"):
        LocalKafkaCluster(tmp_path / "none", brokers=0)


def test_a_broker_alone_is_still_its_own_single_voter(tmp_path: Path) -> None:
    broker = LocalKafkaBroker(tmp_path)
    props = broker.server_properties()
    assert props["controller.quorum.voters"] == f"1@127.0.0.1:{broker.controller_port}"
    assert props["offsets.topic.replication.factor"] == props["transaction.state.log.min.isr"] == "1"


def test_exports_name_the_replication_of_a_cluster() -> None:
    single = export_lines(Services("127.0.0.1:1", "redis://127.0.0.1:2/0", "local"))
    assert "REPLICATION_FACTOR" not in single
    cluster = export_lines(Services("127.0.0.1:1,127.0.0.1:3", "redis://127.0.0.1:2/0", "local", replication=3))
    assert "export KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:1,127.0.0.1:3\n" in cluster
    assert "export ROLLSTREAM__KAFKA__REPLICATION_FACTOR=3\n" in cluster

"""Fixtures of the fault tests: the tiny offline model (hidden 32, 2 layers, vocab 300) and a
3-node Kafka cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollstream.dev.cluster import LocalKafkaCluster
from rollstream.dev.processes import MissingToolError
from rollstream.tiny.text_model import build_tiny_model, default_corpus


def build_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model in the session's base temp dir: built once, whichever conftest asks first."""
    return build_tiny_model(tmp_path_factory.getbasetemp() / "fault-model" / "tiny", default_corpus(),
                            vocab_size=300, hidden_size=32, num_layers=2, num_heads=4)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory)


@pytest.fixture(scope="module")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafkaCluster]:
    """Three local KRaft nodes for the module's tests (small heaps: 2-core CI)."""
    cluster = LocalKafkaCluster(tmp_path_factory.mktemp("cluster"), brokers=3, heap="384m")
    try:
        cluster.start()
    except MissingToolError as exc:  # never a skip: CI installs Java and the jars (scripts/test.sh)
        pytest.fail(f"no local Kafka cluster: {exc}; run `bash scripts/setup.sh` first")
    try:
        yield cluster
    finally:
        cluster.kill()  # its data goes with the test's temp dir: no clean shutdown to wait for

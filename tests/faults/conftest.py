"""Fixtures of the fault tests: the tiny offline model (hidden 32, 2 layers, vocab 300) and a
3-node Kafka cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.tiny_models import build_model
from rollstream.dev.cluster import LocalKafkaCluster
from rollstream.dev.processes import MissingToolError


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

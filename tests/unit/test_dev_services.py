"""Where the dev launcher (tests, the demo, the benchmarks) takes Kafka and Redis from: the
environment, else local processes; testcontainers only when ROLLSTREAM_DEV_SERVICES says so. A
Docker engine that answers but cannot pull an image (no registry) changes nothing by default,
and when containers were asked for, their failure is an error that names the setting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollstream.dev import launcher
from rollstream.dev.launcher import DevServicesError, dev_stack, services_backend

pytestmark = pytest.mark.timeout(30)


class FakeBroker:
    def __init__(self, workdir: Path, **_: Any) -> None:
        self.bootstrap = "127.0.0.1:1"
        self.started = self.stopped = False

    def start(self) -> str:
        self.started = True
        return self.bootstrap

    def stop(self) -> None:
        self.stopped = True


class FakeRedis(FakeBroker):
    url = "redis://127.0.0.1:2/0"


@pytest.fixture
def local_fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "LocalKafkaBroker", FakeBroker)
    monkeypatch.setattr(launcher, "LocalRedisServer", FakeRedis)
    for name in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", launcher.SERVICES_ENV):
        monkeypatch.delenv(name, raising=False)


def _no_docker(*_: Any, **__: Any) -> None:
    raise AssertionError("Docker was asked")


def test_the_choice_is_local_unless_told() -> None:
    assert services_backend({}) == "local"
    assert services_backend({"ROLLSTREAM_DEV_SERVICES": ""}) == "local"
    assert services_backend({"ROLLSTREAM_DEV_SERVICES": " Local "}) == "local"
    assert services_backend({"ROLLSTREAM_DEV_SERVICES": "testcontainers"}) == "testcontainers"
    with pytest.raises(ValueError, match="ROLLSTREAM_DEV_SERVICES='docker'"):
        services_backend({"ROLLSTREAM_DEV_SERVICES": "docker"})


def test_local_services_by_default_without_asking_docker(local_fakes: None, monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    monkeypatch.setattr(launcher, "require_docker", _no_docker)
    monkeypatch.setattr(launcher, "_start_kafka_container", _no_docker)
    monkeypatch.setattr(launcher, "_start_redis_container", _no_docker)
    with dev_stack(tmp_path) as dev:
        assert dev.services.source == "local" and dev.broker.started and dev.redis.started
    assert dev.broker.stopped and dev.redis.stopped


def test_the_environment_wins_over_testcontainers(local_fakes: None, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "broker:9092")
    monkeypatch.setenv("REDIS_URL", "redis://redis:6379/0")
    monkeypatch.setenv(launcher.SERVICES_ENV, "testcontainers")
    monkeypatch.setattr(launcher, "require_docker", _no_docker)
    with dev_stack(tmp_path) as dev:
        assert dev.services.source == "env" and dev.services.kafka_bootstrap == "broker:9092"


def test_testcontainers_without_an_engine_is_an_error_that_says_so(local_fakes: None, monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    import docker  # testcontainers' dependency, installed with rollstream

    def no_engine(**_: Any) -> None:
        raise docker.errors.DockerException("Error while fetching server API version")

    monkeypatch.setattr(docker, "from_env", no_engine)
    monkeypatch.setenv(launcher.SERVICES_ENV, "testcontainers")
    with pytest.raises(DevServicesError, match="no Docker engine answers.*unset it"):
        with dev_stack(tmp_path):
            pass


class UnpullableContainer:
    """What testcontainers does where the engine answers but no registry does."""

    stopped = False

    def start(self) -> None:
        raise RuntimeError("500 Server Error: images/create?fromImage=testcontainers/ryuk: "
                           "lookup registry-1.docker.io: no such host")

    def stop(self) -> None:
        self.stopped = True


def test_a_container_that_cannot_be_pulled_is_an_error_naming_the_setting() -> None:
    import contextlib

    container = UnpullableContainer()
    with contextlib.ExitStack() as stack, pytest.raises(DevServicesError) as raised:
        launcher._start_container(stack, container, "Kafka")
    assert "ROLLSTREAM_DEV_SERVICES=testcontainers" in str(raised.value) and "no such host" in str(raised.value)
    assert container.stopped

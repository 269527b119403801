"""The images compose.yaml builds: each from ``BASE_IMAGE`` (a public image by default, a local
Debian base where no registry answers), under a local name, from a context that holds what the
Dockerfile copies; and the Kafka image's start script, run as written with a stand-in ``java``.

No Docker engine needed; ``scripts/images.sh`` and ``python -m bench.compose_run`` build and run
the images for real (CI, docs/DEPLOYMENT.md).
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from harness.compose import NODES, ROOT, kafka3, load_compose
from rollstream.dev.kafka_jars import KAFKA_VERSION


pytestmark = pytest.mark.timeout(60)

LOCAL_BASE = "local/debian:bookworm"
BUILT = {  # service -> the image it builds
    "kafka": "rollstream-kafka", "redis": "rollstream-redis", "prometheus": "rollstream-prometheus",
    "vllm": "rollstream-vllm", "producer": "rollstream", "trainer": "rollstream",
}


def built_services(env: dict[str, str] | None = None) -> dict[str, dict]:
    return {name: s for name, s in load_compose(env)["services"].items() if "build" in s}


def dockerfile(service: dict) -> Path:
    build = service["build"]
    return ROOT / build["context"] / build.get("dockerfile", "Dockerfile")


def base_image_default(path: Path) -> str:
    """The default of ``ARG BASE_IMAGE`` before the first FROM; every FROM must build on it."""
    text = path.read_text()
    head = text.split("\nFROM", 1)[0]
    match = re.search(r"^ARG BASE_IMAGE=(\S+)$", head, re.MULTILINE)
    assert match, f"{path}: no ARG BASE_IMAGE=<default> before the first FROM"
    froms = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    assert froms and all(f == "${BASE_IMAGE}" for f in froms), f"{path}: FROM {froms}"
    return match.group(1)


def test_every_built_image_builds_from_base_image_with_the_dockerfile_default() -> None:
    services = built_services()
    assert {name: s["image"].split(":")[0] for name, s in services.items() if name in BUILT} == BUILT
    for name, service in services.items():
        default = base_image_default(dockerfile(service))
        assert service["build"]["args"]["BASE_IMAGE"] == default, name  # no BASE_IMAGE: the public image
        assert "/" not in service["image"].split(":")[0], f"{name}: a built image must not take a registry's name"
    for name, service in built_services({"BASE_IMAGE": LOCAL_BASE}).items():
        assert service["build"]["args"]["BASE_IMAGE"] == LOCAL_BASE, name


def test_kafka_image_is_the_version_the_dev_broker_runs() -> None:
    assert built_services()["kafka"]["image"] == f"rollstream-kafka:{KAFKA_VERSION}"
    pom = (ROOT / "rollstream" / "dev" / "pom.xml").read_text()
    assert f"<kafka.version>{KAFKA_VERSION}</kafka.version>" in pom
    assert "COPY rollstream/dev/pom.xml" in dockerfile(built_services()["kafka"]).read_text()


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore's rule, enough for our file: the last pattern matching the path or a
    folder above it decides; ``!`` re-includes."""
    ignored = False
    parts = path.split("/")
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def test_the_build_context_holds_what_each_dockerfile_copies() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for name, service in built_services().items():
        assert service["build"]["context"] == ".", name
        for line in dockerfile(service).read_text().splitlines():
            if not line.startswith("COPY ") or "--from=" in line:
                continue
            for source in shlex.split(line)[1:-1]:
                assert (ROOT / source).exists(), f"{name}: {line}"
                assert not _ignored(source, patterns), f"{name}: {source} is left out by .dockerignore"


def test_the_rollstream_image_does_not_hide_its_package() -> None:
    """A ``rollstream/`` folder in a directory on PYTHONPATH shadows the installed package, whose
    tiers come from the tier folders (``rollstream.producers``...): every tier failed at import."""
    text = (ROOT / "Dockerfile").read_text()
    workdir = re.findall(r"^WORKDIR (\S+)", text, re.MULTILINE)[-1]
    pythonpath = re.search(r"PYTHONPATH=(\S+)", text).group(1).split(":")
    assert workdir in pythonpath
    for line in text.splitlines():
        if line.startswith("COPY "):
            *sources, target = shlex.split(line)[1:]
            inside = target.startswith(("./", workdir)) or not target.startswith("/")
            assert not (inside and any(Path(s).name in ("rollstream", ".") for s in sources)), line


def run_kafka_start(service: dict, tmp_path: Path) -> tuple[dict[str, str], list[str]]:
    """The kafka service's command as compose runs it (the node guard, then the image's start
    script), with a stand-in ``java`` that records its arguments; returns the written
    server.properties and the java calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "java-calls"
    (bin_dir / "java").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (bin_dir / "java").chmod(0o755)
    config = tmp_path / "server.properties"
    start = ROOT / "deploy" / "images" / "kafka" / "run"
    command = [part.replace("$$", "$").replace("/etc/kafka/docker/run", str(start)) for part in service["command"]]
    env = {**{k: str(v) for k, v in service["environment"].items()},
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "SERVER_PROPERTIES": str(config)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    properties = dict(line.split("=", 1) for line in config.read_text().splitlines())
    return properties, calls.read_text().splitlines()


def test_kafka_start_script_turns_the_environment_into_broker_properties(tmp_path: Path) -> None:
    service = load_compose()["services"]["kafka"]
    properties, calls = run_kafka_start(service, tmp_path)
    env = service["environment"]
    assert properties["node.id"] == "1" and properties["process.roles"] == "broker,controller"
    assert properties["controller.quorum.voters"] == env["KAFKA_CONTROLLER_QUORUM_VOTERS"]
    assert properties["log.dirs"] == "/var/lib/kafka/data"
    assert properties["transaction.state.log.min.isr"] == env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"]
    assert properties["advertised.listeners"] == env["KAFKA_ADVERTISED_LISTENERS"]
    assert len(properties) == len([k for k in env if k.startswith("KAFKA_")])  # one each, nothing else
    assert "CLUSTER_ID" not in properties and "cluster.id" not in properties
    format_call, broker_call = calls
    assert "kafka.tools.StorageTool format" in format_call and f"--cluster-id {env['CLUSTER_ID']}" in format_call
    assert broker_call.endswith(f"kafka.Kafka {tmp_path / 'server.properties'}")
    assert "-Xmx" not in broker_call  # KAFKA_HEAP_OPTS is the image's (ENV), not a property


@pytest.mark.parametrize("name", NODES)
def test_kafka_start_script_on_each_node_of_the_cluster(tmp_path: Path, name: str) -> None:
    properties, _ = run_kafka_start(kafka3()["services"][name], tmp_path)
    assert properties["node.id"] == str(NODES.index(name) + 1)
    assert properties["default.replication.factor"] == "3" and properties["min.insync.replicas"] == "2"


def test_kafka_property_names_follow_apache_kafkas_image(tmp_path: Path) -> None:
    service = {"command": ["/etc/kafka/docker/run"], "environment": {
        "CLUSTER_ID": "BMFU51xzQaSdTaY5aJIsOg", "KAFKA_NODE_ID": "1",
        "KAFKA_LISTENER_NAME_EXTERNAL_SCRAM___SHA___256_SASL__JAAS__CONFIG": "x",  # ___ -> -, __ -> _
        "KAFKA_HEAP_OPTS": "-Xmx1g", "KAFKA_OPTS": "-Dx=1",  # the JVM's, not properties
        "KAFKA_ADVERTISED_LISTENERS": "PLAINTEXT://kafka:9092",
    }}
    properties, calls = run_kafka_start(service, tmp_path)
    assert properties == {"node.id": "1", "listener.name.external.scram-sha-256.sasl_jaas_config": "x",
                          "advertised.listeners": "PLAINTEXT://kafka:9092",
                          "listeners": "PLAINTEXT://0.0.0.0:9092"}  # derived, as apache/kafka does
    assert "-Xmx1g" in calls[-1] and "-Dx=1" in calls[-1]


def test_the_health_check_and_the_docs_find_their_kafka_tools() -> None:
    services = load_compose()["services"]
    check = services["kafka"]["healthcheck"]["test"][1]
    tools = set(re.findall(r"/opt/kafka/bin/([\w.-]+\.sh)", check))
    tools |= set(re.findall(r"\b(kafka-[\w-]+\.sh)\b", (ROOT / "docs" / "DEPLOYMENT.md").read_text()))
    shipped = {p.name for p in (ROOT / "deploy" / "images" / "kafka" / "bin").iterdir()}
    assert tools and tools <= shipped, sorted(tools - shipped)
    assert "COPY deploy/images/kafka/run /etc/kafka/docker/run" in dockerfile(services["kafka"]).read_text()


def test_image_scripts_parse() -> None:
    for script in ("scripts/images.sh", "deploy/images/make-base.sh", "deploy/images/kafka/run",
                   "deploy/images/python-venv.sh"):
        done = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"{script}: {done.stderr}"


def test_ci_runs_the_suite_first_then_the_compose_deployment() -> None:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert "set -euo pipefail" in lines  # a failed step fails CI
    suite, deployment = lines.index("bash scripts/test.sh"), lines.index("bash scripts/compose_check.sh")
    assert suite < deployment, "the suite gates CI first"
    check = (ROOT / "scripts" / "compose_check.sh").read_text()
    assert "set -euo pipefail" in check and "bash scripts/images.sh" in check
    assert "python -m bench.compose_run" in check

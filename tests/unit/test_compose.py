"""compose.yaml is valid and every rollstream service runs a real rollstream command.

No Docker engine needed: the file is checked against the Compose Specification JSON schema
(vendored, see tests/data/README.md) and, where installed, by ``docker-compose config``
(Debian's docker-compose 1.29 validates offline) or ``docker compose config``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from harness.compose import COMPOSE, ROOT, load_compose, rollstream_services
from rollstream.config import load_config


SCHEMA = ROOT / "tests" / "data" / "compose_spec.json"
PROFILES = ("gpu", "cpu", "monitoring", "kafka3")
CONFIGS = ("rollstream.yaml", "rollstream-cpu.yaml")
TIERS = ("producer", "rollout-worker", "rollout-worker-cpu", "reward-worker", "grouping", "dump", "trainer")
def test_compose_matches_the_compose_spec_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(load_compose())]
    assert not errors, "\n".join(errors)


def test_the_schema_catches_mistakes() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    broken = load_compose()
    broken["services"]["producer"]["comand"] = ["rollstream"]  # a typo of a key
    broken["services"]["redis"]["healthcheck"]["retries"] = "many"
    assert len(list(validator.iter_errors(broken))) >= 2


def _compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


@pytest.mark.parametrize("config_name", CONFIGS)
def test_docker_compose_config_accepts_every_profile(config_name: str) -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM", "KAFKA", "REDIS", "COMPOSE"))}
    env["ROLLSTREAM_CONFIG"] = config_name
    profiles = [arg for p in PROFILES for arg in ("--profile", p)]
    done = subprocess.run([*cli, "-f", str(COMPOSE), *profiles, "config", "-q"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


def _help_argv(command: list[str]) -> list[str]:
    assert command[0] == "rollstream", f"not a rollstream command: {command}"
    return [sys.executable, "-m", "rollstream.cli", *command[1:], "--help"]


def test_every_rollstream_service_runs_a_real_rollstream_command() -> None:
    commands = sorted({tuple(s["command"]) for s in rollstream_services(load_compose()).values()})
    assert len(commands) >= 7
    # all at once: each start imports torch (through the tools), seconds apiece
    running = [(c, subprocess.Popen(_help_argv(list(c)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
               for c in commands]
    for command, proc in running:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{' '.join(command)} --help failed:\n{err}"
        assert "usage: rollstream" in out


@pytest.mark.parametrize("config_name", CONFIGS)
def test_each_service_config_loads_with_its_environment(config_name: str) -> None:
    compose = load_compose({"ROLLSTREAM_CONFIG": config_name})
    for name, service in rollstream_services(compose).items():
        command = service["command"]
        if "--config" not in command:
            continue
        mounted = command[command.index("--config") + 1]
        assert mounted == f"/etc/rollstream/{config_name}", name
        environ = {k: str(v) for k, v in service["environment"].items()}
        config = load_config(ROOT / "deploy" / config_name, environ=environ)  # ConfigError if invalid
        assert config.kafka.bootstrap_servers == "kafka:9092" and config.metrics.port == 9100, name
        if name == "rollout-worker":
            assert config.rollout.engine == "sglang" and config.rollout.server_urls == ["http://sglang:30000"]
        if name == "rollout-worker-cpu":
            assert config.rollout.engine == "vllm" and config.rollout.server_urls == ["http://vllm:8000"]


def test_services_profiles_and_volumes() -> None:
    compose = load_compose()
    services = compose["services"]
    assert services["kafka"]["image"].startswith("rollstream-kafka:")
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft
    assert any(v.endswith(":/var/lib/kafka/data") for v in services["kafka"]["volumes"])
    sglang = services["sglang"]
    assert sglang["image"].startswith("lmsysorg/sglang") and sglang["ipc"] == "host"
    device = sglang["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    start = sglang["healthcheck"]["start_period"]
    assert start.endswith("s") and int(start[:-1]) >= 300
    by_profile: dict[str, set[str]] = {}
    for name, service in services.items():
        for profile in service.get("profiles", []):
            by_profile.setdefault(profile, set()).add(name)
    assert by_profile == {"gpu": {"sglang", "rollout-worker"}, "cpu": {"vllm", "rollout-worker-cpu"},
                          "monitoring": {"prometheus", "grafana"}, "kafka3": {"kafka-2", "kafka-3"}}
    for name in ("rollout-worker", "rollout-worker-cpu", "reward-worker"):  # --scale needs no fixed names
        assert "container_name" not in services[name] and "hostname" not in services[name]
    named = {v.split(":")[0] for s in services.values() for v in s.get("volumes", []) if not v.startswith(".")}
    assert named <= set(compose["volumes"])
    published = [port for s in services.values() for port in s.get("ports", [])]
    assert all(port.split(":")[0] in ("0.0.0.0", "127.0.0.1") for port in published), published
    assert all(port.startswith("127.0.0.1:") for port in
               (p for s in load_compose({"PUBLISH_ADDRESS": "127.0.0.1"})["services"].values() for p in s.get("ports", [])))


def test_topics_are_created_before_the_tiers_start() -> None:
    services = load_compose()["services"]
    assert services["topics"]["command"][:3] == ["rollstream", "topics", "create"]
    for tier in TIERS:
        depends = services[tier]["depends_on"]
        assert depends["topics"]["condition"] == "service_completed_successfully", tier
        assert depends["kafka"]["condition"] == "service_healthy", tier


def test_prometheus_scrapes_every_tier_on_the_metrics_port() -> None:
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"]
    sd = [c for job in scrape for c in job.get("dns_sd_configs", [])]
    assert {name for c in sd for name in c["names"]} >= set(TIERS)
    port = load_compose()["services"]["producer"]["environment"]["ROLLSTREAM__METRICS__PORT"]
    assert {c["port"] for c in sd} == {int(port)}


def _exported_metric_names() -> set[str]:
    import rollstream.runtime.metrics as metrics
    from prometheus_client.metrics import MetricWrapperBase

    names: set[str] = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                names.add(family.name)
                suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
                names.update(family.name + s for s in suffixes)
    return names


def test_grafana_dashboard_uses_only_exported_metrics() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "rollstream.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"rollstream_[a-z_]+", expr)}
    exported = _exported_metric_names()
    assert used and used <= exported, sorted(used - exported)
    assert len({n for n in used if not n.endswith(("_bucket", "_sum", "_count"))} | {
        n.rsplit("_", 1)[0] for n in used if n.endswith(("_bucket", "_sum", "_count"))}) >= 10
    provisioned = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert {d["uid"] for d in provisioned["datasources"]} == {
        p["datasource"]["uid"] for p in dashboard["panels"]}

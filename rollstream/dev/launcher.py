"""Find or start the Kafka broker and Redis that tests and the local demo run against.

Each service comes from the environment (KAFKA_BOOTSTRAP_SERVERS / REDIS_URL: nothing is started
or stopped), else from local processes (`LocalKafkaBroker` from Maven jars, `LocalRedisServer`),
or, only with ROLLSTREAM_DEV_SERVICES=testcontainers, from containers; a missing engine or a
failed pull is then an error, not a silent fallback (why: docs/ARCHITECTURE.md, "Decisions").
With `brokers` > 1, Kafka is a local replicated cluster (`LocalKafkaCluster`) unless
KAFKA_BOOTSTRAP_SERVERS names one.

`dev_stack()` stops exactly what it started. `dev_up()` / `dev_down()` start and stop local
services that outlive the Python process, recorded in `<state_dir>/state.json`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from rollstream.dev.broker import LocalKafkaBroker
from rollstream.dev.cluster import LocalKafkaCluster
from rollstream.dev.processes import LocalServer, pid_alive, stop_pid, terminate_pid
from rollstream.dev.redis_server import LocalRedisServer

_Server = TypeVar("_Server", bound=LocalServer)

logger = logging.getLogger(__name__)

KAFKA_ENV = "KAFKA_BOOTSTRAP_SERVERS"
REDIS_ENV = "REDIS_URL"
SERVICES_ENV = "ROLLSTREAM_DEV_SERVICES"
LOCAL = "local"
TESTCONTAINERS = "testcontainers"
REPLICATION_ENV = "ROLLSTREAM__KAFKA__REPLICATION_FACTOR"
STATE_FILE = "state.json"


@dataclass(frozen=True)
class Services:
    """Where the services are. `source` is "env", "testcontainers" or "local" when both
    services came from the same place, else e.g. "kafka=env,redis=local". `replication` is
    the replication factor a local cluster gives topics (1 unless a cluster was started here)."""

    kafka_bootstrap: str
    redis_url: str
    source: str
    replication: int = 1


@dataclass
class DevStack:
    """The resolved services plus the local process objects (None when not started locally),
    so fault tests can stop, kill and restart them. `broker` is the one-node broker; a
    replicated local cluster is `cluster` (and `broker` is None then)."""

    services: Services
    broker: LocalKafkaBroker | None = None
    redis: LocalRedisServer | None = None
    cluster: LocalKafkaCluster | None = None


class DevStateError(RuntimeError):
    """`rollstream dev` found no running services, or a state file it cannot use."""


class DevServicesError(RuntimeError):
    """The services asked for (ROLLSTREAM_DEV_SERVICES) cannot be had; the message says why."""


def services_backend(environ: Mapping[str, str] | None = None) -> str:
    """Where Kafka and Redis come from when the environment names none: "local" (the default)
    or "testcontainers" (ROLLSTREAM_DEV_SERVICES=testcontainers). ValueError for another value."""
    environ = os.environ if environ is None else environ
    value = environ.get(SERVICES_ENV, "").strip().lower() or LOCAL
    if value not in (LOCAL, TESTCONTAINERS):
        raise ValueError(f"{SERVICES_ENV}={value!r}: use {LOCAL!r} (the default) or {TESTCONTAINERS!r}")
    return value


def export_lines(services: Services) -> str:
    """Shell lines that point clients at `services`, one `export NAME=value` per line (with a
    replicated cluster, also the replication factor its topics should get)."""
    lines = (
        f"export {KAFKA_ENV}={shlex.quote(services.kafka_bootstrap)}\n"
        f"export {REDIS_ENV}={shlex.quote(services.redis_url)}\n"
    )
    if services.replication > 1:
        lines += f"export {REPLICATION_ENV}={services.replication}\n"
    return lines


def require_docker(timeout: float = 2.0) -> None:
    """Return when testcontainers is installed and a Docker engine answers a ping in time;
    DevServicesError saying which is missing otherwise."""
    try:
        import docker  # optional (dev extra)
        import testcontainers  # noqa: F401  (optional too)
    except ImportError as exc:
        raise DevServicesError(f"{SERVICES_ENV}={TESTCONTAINERS} needs the dev extra ({exc})") from exc
    try:
        with contextlib.closing(docker.from_env(timeout=timeout)) as client:
            client.ping()
    except Exception as exc:  # no engine, no socket, no permission
        raise DevServicesError(f"{SERVICES_ENV}={TESTCONTAINERS}, but no Docker engine answers ({exc!r}); "
                               f"unset it to use local services") from exc


@contextlib.contextmanager
def dev_stack(workdir: Path | None = None, brokers: int = 1) -> Iterator[DevStack]:
    """Resolve both services (see the module docstring) and stop what was started on exit.

    Local processes keep their data and logs under `workdir`; without one, a temporary
    directory is used and removed afterwards. `brokers` > 1 starts a local replicated cluster.
    """
    with contextlib.ExitStack() as stack:
        kafka_env, redis_env = os.environ.get(KAFKA_ENV), os.environ.get(REDIS_ENV)
        use_docker = not (kafka_env and redis_env) and services_backend() == TESTCONTAINERS
        if use_docker:
            require_docker()
        local_cluster = brokers > 1 and not kafka_env
        if workdir is None and (local_cluster or not (kafka_env and redis_env) and not use_docker):
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollstream-dev-")))
        cluster = None
        if local_cluster:
            assert workdir is not None
            cluster = LocalKafkaCluster(workdir / "kafka", brokers)
            stack.callback(cluster.stop)  # registered first: a failed start still cleans up
            kafka_source, bootstrap, broker = "local", cluster.start(), None
        else:
            kafka_source, bootstrap, broker = _resolve(stack, kafka_env, use_docker, _start_kafka_container,
                                                       workdir, lambda root: LocalKafkaBroker(root / "kafka"))
        redis_source, url, redis = _resolve(stack, redis_env, use_docker, _start_redis_container,
                                            workdir, lambda root: LocalRedisServer(root / "redis"))
        replication = cluster.replication if cluster is not None else 1
        source = (kafka_source if kafka_source == redis_source
                  else f"kafka={kafka_source},redis={redis_source}")
        services = Services(bootstrap, url, source, replication)
        logger.info("dev services: %s", services)
        yield DevStack(services, broker, redis, cluster)


def _resolve(stack: contextlib.ExitStack, env: str | None, docker: bool,
             start_container: Callable[[contextlib.ExitStack], str], workdir: Path | None,
             local: Callable[[Path], _Server]) -> tuple[str, str, _Server | None]:
    """(source, address, local server): the address in `env`, else a container, else a local
    process made by `local(workdir)`."""
    if env:
        return "env", env, None
    if docker:
        return "testcontainers", start_container(stack), None
    assert workdir is not None
    server = local(workdir)
    stack.callback(server.stop)  # registered first: a failed start still cleans up
    return "local", server.start(), server


def _start_kafka_container(stack: contextlib.ExitStack) -> str:
    try:
        from testcontainers.community.kafka import KafkaContainer
    except ImportError:  # testcontainers < 4.9 kept the modules at the top level
        from testcontainers.kafka import KafkaContainer  # type: ignore[no-redef]

    # One KRaft node: transactions need their state log at replication 1, and our tiers
    # create their own topics.
    container = (
        KafkaContainer()
        .with_kraft()
        .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
        .with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
    )
    _start_container(stack, container, "Kafka")
    return str(container.get_bootstrap_server())


def _start_redis_container(stack: contextlib.ExitStack) -> str:
    try:
        from testcontainers.community.redis import RedisContainer
    except ImportError:
        from testcontainers.redis import RedisContainer  # type: ignore[no-redef]

    container = RedisContainer()
    _start_container(stack, container, "Redis")
    host, port = container.get_container_host_ip(), container.get_exposed_port(container.port)
    return f"redis://{host}:{port}/0"


def _start_container(stack: contextlib.ExitStack, container: Any, what: str) -> None:
    try:
        container.start()
    except Exception as exc:  # a pull refused (no registry), an engine error
        with contextlib.suppress(Exception):
            container.stop()
        raise DevServicesError(f"{SERVICES_ENV}={TESTCONTAINERS}: the {what} container did not start "
                               f"({exc}); unset it to use local services") from exc
    stack.callback(container.stop)


def dev_up(state_dir: Path, brokers: int = 1) -> Services:
    """Start local Kafka (one broker, or a cluster of `brokers` nodes) and Redis that outlive
    this process; record them in state.json.

    Returns the running services unchanged when they are already up with the same number of
    brokers; DevStateError when they are up with another number (stop them first).
    """
    state_dir = Path(state_dir).resolve()
    state = _read_state(state_dir)
    if state is not None:
        if _alive(state):
            running = len(_kafka_nodes(state))
            if running != brokers:
                raise DevStateError(
                    f"dev services in {state_dir} run {running} broker(s), not {brokers}; "
                    "stop them with `rollstream dev down` first"
                )
            return Services(**state["services"])
        dev_down(state_dir)  # leftovers of a crash: clear them before starting again
    state_dir.mkdir(parents=True, exist_ok=True)
    kafka = (LocalKafkaCluster(state_dir / "kafka", brokers, detached=True) if brokers > 1
             else LocalKafkaBroker(state_dir / "kafka", detached=True))
    redis = LocalRedisServer(state_dir / "redis", detached=True)
    kafka.start()
    try:
        redis.start()
    except BaseException:
        kafka.stop()
        raise
    nodes = list(kafka.nodes.values()) if isinstance(kafka, LocalKafkaCluster) else [kafka]
    replication = kafka.replication if isinstance(kafka, LocalKafkaCluster) else 1
    services = Services(kafka.bootstrap, redis.url, "local", replication)
    _write_state(state_dir, services, nodes, redis)
    return services


def dev_down(state_dir: Path) -> bool:
    """Stop the services `dev_up` started and delete their data; False when none were up."""
    state_dir = Path(state_dir).resolve()
    state = _read_state(state_dir)
    if state is None:
        return False
    stopped = _alive(state)
    nodes = _kafka_nodes(state)
    for node in nodes:  # all at once: one by one, the last nodes would wait for a lost quorum
        terminate_pid(node["pid"], must_contain=node["cmdline_mark"])
    for node in nodes:
        stop_pid(node["pid"], must_contain=node["cmdline_mark"])
    stop_pid(state["redis"]["pid"], must_contain=state["redis"]["cmdline_mark"])
    for name in ("kafka", "redis"):
        shutil.rmtree(state_dir / name, ignore_errors=True)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    return stopped


def dev_env(state_dir: Path) -> str:
    """The export lines for the services `dev_up` started; DevStateError when none run."""
    state = _read_state(Path(state_dir).resolve())
    if state is None or not _alive(state):
        raise DevStateError(f"no dev services running for {state_dir} (run `rollstream dev up`)")
    return export_lines(Services(**state["services"]))


def _kafka_nodes(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The recorded Kafka processes: `kafka` (one broker) or `kafka_nodes` (a cluster)."""
    return list(state.get("kafka_nodes") or [state["kafka"]])


def _alive(state: dict[str, Any]) -> bool:
    return all(pid_alive(node["pid"]) for node in _kafka_nodes(state)) and pid_alive(state["redis"]["pid"])


def _read_state(state_dir: Path) -> dict[str, Any] | None:
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        state: dict[str, Any] = json.loads(path.read_text())
        for node in _kafka_nodes(state):
            int(node["pid"])  # TypeError when null
        int(state["redis"]["pid"])
        Services(**state["services"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DevStateError(f"unreadable dev state {path} ({exc!r}); delete it by hand") from exc
    return state


def _write_state(
    state_dir: Path, services: Services, nodes: list[LocalKafkaBroker], redis: LocalRedisServer
) -> None:
    records = [
        {
            "node_id": node.node_id,
            "pid": node.pid,
            "port": node.port,
            "controller_port": node.controller_port,
            "log": str(node.log_path),
            # what /proc/<pid>/cmdline must contain before dev_down signals the pid
            "cmdline_mark": str(node.workdir / "server.properties"),
        }
        for node in nodes
    ]
    state: dict[str, Any] = {
        "services": asdict(services),
        "kafka": records[0],
        "kafka_nodes": records,
        "redis": {
            "pid": redis.pid,
            "port": redis.port,
            "log": str(redis.log_path),
            "cmdline_mark": "redis-server",
        },
    }
    path = state_dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(path)

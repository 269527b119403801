"""One Apache Kafka node (KRaft, combined broker+controller) run from Maven jars.

Used by the test fixtures and `rollstream dev up`. The broker is real Kafka: transactions,
consumer groups, compaction and restarts behave as in production. Alone (the default) it is a
one-node cluster with replication 1; with a `NodeLayout` it is one voter of a replicated
cluster (see `rollstream.dev.cluster`).

Ports are chosen once, at construction, and kept across `restart()`, so clients built with
`bootstrap` before a restart reconnect to the same address afterwards. The data directory is kept
too: storage is formatted on the first start only.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import re
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from rollstream.dev.kafka_jars import LOG4J_CONFIG, classpath, ensure_kafka_jars, java_executable
from rollstream.dev.processes import LOCALHOST, LocalServer, free_port, port_open

logger = logging.getLogger(__name__)

STARTED_LINE = "Kafka Server started"
SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
_SCRAM_SAFE = re.compile(r"^[^\s,=\[\]\"']+$")


# A local broker is for development and tests, where it starts often and carries little: one
# GC thread, and only the JIT's quick tier (C1), which on 2 cores brings a start (and a node's
# restart in a cluster) from 10-15 s to 5-8 s (measured side by side, the machine busy).
QUICK_START_JVM = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")

class BrokerStartError(RuntimeError):
    """The broker did not become ready; the message ends with the last lines of its log."""


def new_cluster_id() -> str:
    """A random 22-character URL-safe base64 UUID, as `kafka-storage random-uuid` prints."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):  # would be parsed as an option by StorageTool
            return cluster_id


@dataclass(frozen=True)
class NodeLayout:
    """Where one node sits in a replicated cluster.

    `voters` is `controller.quorum.voters` ("1@127.0.0.1:PORT,2@..."), the same on every node;
    `cluster_id` is formatted into every node's storage. `replication` is the replication
    factor of new topics and of the internal topics (consumer offsets, transaction state),
    `min_insync` their `min.insync.replicas`.
    """

    node_id: int
    voters: str
    cluster_id: str
    replication: int
    min_insync: int


class LocalKafkaBroker(LocalServer):
    """One KRaft broker process on 127.0.0.1, its data and log under `workdir`.

    `sasl_scram_users` (name -> password) adds a SASL_PLAINTEXT listener with SCRAM-SHA-256 and
    SCRAM-SHA-512 for those users, at `sasl_bootstrap`. `detached=True` lets the broker outlive
    this Python process (used by `rollstream dev up`). Without `layout` it is a cluster of its
    own (node 1, the only voter, replication 1). Ports are fixed at construction; a cluster
    passes `controller_port` (the one its `layout.voters` names for this node).
    """

    START_TIMEOUT = 120.0
    STOP_TIMEOUT = 30.0
    START_ERROR = BrokerStartError

    def __init__(
        self,
        workdir: Path,
        heap: str = "512m",
        sasl_scram_users: dict[str, str] | None = None,
        detached: bool = False,
        layout: NodeLayout | None = None,
        controller_port: int | None = None,
    ) -> None:
        self.sasl_scram_users = dict(sasl_scram_users or {})
        for user, password in self.sasl_scram_users.items():
            if not (_SCRAM_SAFE.match(user) and _SCRAM_SAFE.match(password)):
                raise ValueError(
                    f"SCRAM user {user!r}: names and passwords may not contain whitespace, quotes or ,=[]"
                )
        name = "kafka broker" if layout is None else f"kafka node {layout.node_id}"
        super().__init__(workdir, name, "broker.log", detached)
        self.heap = heap
        self.layout = layout
        self.controller_port = free_port() if controller_port is None else controller_port
        self.sasl_port: int | None = free_port() if self.sasl_scram_users else None

    @property
    def node_id(self) -> int:
        return 1 if self.layout is None else self.layout.node_id

    @property
    def bootstrap(self) -> str:
        """The PLAINTEXT bootstrap address, "127.0.0.1:PORT"; stable across restarts."""
        return f"{LOCALHOST}:{self.port}"

    @property
    def sasl_bootstrap(self) -> str | None:
        """The SASL_PLAINTEXT (SCRAM) bootstrap address, or None without SCRAM users."""
        return None if self.sasl_port is None else f"{LOCALHOST}:{self.sasl_port}"

    def start(self, timeout: float | None = None) -> str:
        """Start the broker and block until it serves metadata; return `bootstrap`.

        Sets `startup_seconds` (formatting on first start included). Raises BrokerStartError with
        the log's tail when the process exits or is not ready within `timeout` seconds.
        """
        began = time.monotonic()
        offset = self.launch()
        self.wait_ready(offset, began, began + (self.START_TIMEOUT if timeout is None else timeout))
        return self.bootstrap

    def launch(self) -> int:
        """Format storage on first use and start the process without waiting for it.

        Returns the log offset where this start's output begins, for `wait_ready`. A node of a
        replicated cluster cannot become ready alone (it needs a quorum of voters), so a
        cluster launches every node first and then waits for each.
        """
        libs = ensure_kafka_jars()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        if not (self._data_dir / "meta.properties").exists():
            self._format(libs, config)
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0  # this start writes from here
        argv = [
            java_executable(), "-Xms128m", f"-Xmx{self.heap}", *QUICK_START_JVM,
            "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
            "-cp", classpath(libs), "kafka.Kafka", str(config),
        ]
        self._process.start(argv, cwd=self.workdir)
        return offset

    def wait_ready(self, log_offset: int, began: float, deadline: float) -> None:
        """Block until the started process serves metadata; set `startup_seconds` from `began`.

        Kills the process and raises BrokerStartError (with the log's tail) when it exits or
        is not ready by `deadline` (both `time.monotonic()` values).
        """
        self._await_ready(lambda: self._serves_metadata(log_offset, deadline), began, deadline - began, 0.1,
                          "kafka broker", "not ready in time")
        logger.info("kafka node %d ready at %s in %.2fs", self.node_id, self.bootstrap, self.startup_seconds)

    @property
    def _data_dir(self) -> Path:
        return self.workdir / "data"

    def _write_config(self) -> Path:
        path = self.workdir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in self.server_properties().items()))
        return path

    def server_properties(self) -> dict[str, str]:
        """The broker configuration written to `workdir/server.properties` before each start."""
        listeners = [f"PLAINTEXT://{self.bootstrap}", f"CONTROLLER://{LOCALHOST}:{self.controller_port}"]
        advertised = [f"PLAINTEXT://{self.bootstrap}"]
        protocols = ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": (self.layout.voters if self.layout
                                         else f"1@{LOCALHOST}:{self.controller_port}"),
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self._data_dir),
            "num.partitions": "1",
            "auto.create.topics.enable": "false",  # each tier creates its own topics
            "offsets.topic.num.partitions": "4",  # small: the first group commit is faster
            "transaction.state.log.num.partitions": "4",
            **self._replication_properties(),
            "group.initial.rebalance.delay.ms": "0",
            # after a kill, the restarted broker waits for its old session to expire before it
            # is unfenced (9 s by default); a short session makes crash tests quicker
            "broker.heartbeat.interval.ms": "500",
            "broker.session.timeout.ms": "4000",
            # compacted topics (changelogs) get cleaned within a test's lifetime once a segment
            # rolls; tests that need compaction set segment.ms on their topic
            "log.cleaner.enable": "true",
            "log.cleaner.threads": "1",
            "log.cleaner.backoff.ms": "200",
            "log.cleaner.min.cleanable.ratio": "0.01",
            "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
            # two cores in CI: fewer threads than the defaults
            "num.network.threads": "2",
            "num.io.threads": "4",
            "background.threads": "4",
        }
        if self.sasl_port is not None:
            sasl = f"SASL_PLAINTEXT://{LOCALHOST}:{self.sasl_port}"
            listeners.append(sasl)
            advertised.append(sasl)
            protocols.append("SASL_PLAINTEXT:SASL_PLAINTEXT")
            props["sasl.enabled.mechanisms"] = ",".join(SCRAM_MECHANISMS)
            for mechanism in SCRAM_MECHANISMS:
                key = f"listener.name.sasl_plaintext.{mechanism.lower()}.sasl.jaas.config"
                props[key] = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        props["listeners"] = ",".join(listeners)
        props["advertised.listeners"] = ",".join(advertised)
        props["listener.security.protocol.map"] = ",".join(protocols)
        return props

    def _replication_properties(self) -> dict[str, str]:
        """Replication of new and internal topics: 1 alone; the layout's in a cluster."""
        replication = 1 if self.layout is None else self.layout.replication
        min_insync = 1 if self.layout is None else self.layout.min_insync
        props = {
            "default.replication.factor": str(replication),
            "min.insync.replicas": str(min_insync),
            "offsets.topic.replication.factor": str(replication),
            "transaction.state.log.replication.factor": str(replication),
            "transaction.state.log.min.isr": str(min_insync),
            "share.coordinator.state.topic.replication.factor": str(replication),
            "share.coordinator.state.topic.min.isr": str(min_insync),
            # never elect a replica that missed acknowledged writes (Kafka's default, stated)
            "unclean.leader.election.enable": "false",
        }
        if self.layout is not None:
            # a stopped or paused follower leaves the ISR after this long (default 30 s), and
            # acks=all writes wait for it until then; fenced brokers leave it at once
            props["replica.lag.time.max.ms"] = "10000"
        return props

    def _format(self, libs: Path, config: Path) -> None:
        argv = [
            java_executable(), "-Xmx256m", *QUICK_START_JVM,
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
            "-cp", classpath(libs), "kafka.tools.StorageTool", "format",
            "-t", new_cluster_id() if self.layout is None else self.layout.cluster_id, "-c", str(config),
        ]
        for name, password in self.sasl_scram_users.items():
            for mechanism in SCRAM_MECHANISMS:
                argv += ["--add-scram", f"{mechanism}=[name={name},password={password}]"]
        with self.log_path.open("ab") as log:
            log.write(b"\n==== formatting storage\n")
            log.flush()
            result = subprocess.run(
                argv, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, timeout=120,
            )
        if result.returncode != 0:
            self._fail(f"kafka storage format failed (exit {result.returncode})")

    def _serves_metadata(self, log_offset: int, deadline: float) -> bool:
        """The started line is in this start's log output and a metadata request is answered."""
        with self.log_path.open("rb") as handle:  # there since the start (ServiceProcess.start)
            handle.seek(log_offset)
            if STARTED_LINE.encode() not in handle.read() or not port_open(self.port):
                return False
        return _metadata_answers(self.bootstrap, max(1.0, deadline - time.monotonic()))


def _metadata_answers(bootstrap: str, timeout: float) -> bool:
    """True when a real Kafka metadata request to `bootstrap` lists at least one broker.

    Runs aiokafka on its own event loop in a worker thread, so it works whether or not the
    caller is inside a running loop.
    """
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            return pool.submit(asyncio.run, _probe(bootstrap, timeout)).result(timeout + 5)
        except Exception as exc:  # not ready yet: any failure means "ask again"
            logger.debug("metadata probe of %s failed: %r", bootstrap, exc)
            return False


async def _probe(bootstrap: str, timeout: float) -> bool:
    from aiokafka import AIOKafkaClient  # heavy import, only needed here

    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000))
    try:
        await asyncio.wait_for(client.bootstrap(), timeout)
        return bool(client.cluster.brokers())
    finally:
        await client.close()

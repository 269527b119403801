"""A replicated Apache Kafka cluster on this machine: N KRaft nodes from the same jars.

Every node is a combined broker+controller and a voter of the controller quorum (three nodes:
three voters, so the cluster keeps a quorum with one node down). New topics and the internal
topics (consumer offsets, transaction state) get replication `min(N, 3)` and
`min.insync.replicas` `replication - 1` (2 for three nodes): an `acks=all` write is on two
replicas before it is acknowledged, and the cluster keeps accepting writes with one node down.

Used by `rollstream dev up --brokers 3`, the cluster fault tests and the scale-out benchmark.
Each node keeps its ports and data directory across `stop_node` / `start_node`, so clients
built with `bootstrap` reconnect to the same addresses after a restart. `pause_node` freezes a
node (SIGSTOP): to the others it looks like a node cut off by a network partition, which still
holds its sockets open.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from rollstream.dev.broker import BrokerStartError, LocalKafkaBroker, NodeLayout, new_cluster_id
from rollstream.dev.processes import LOCALHOST, free_port

logger = logging.getLogger(__name__)

MAX_REPLICATION = 3


class LocalKafkaCluster:
    """`brokers` local KRaft nodes under `workdir/node-<id>`; use `start()`/`stop()` or `with`."""

    START_TIMEOUT = 180.0

    def __init__(self, workdir: Path, brokers: int = 3, heap: str = "384m", detached: bool = False) -> None:
        if brokers < 1:
            raise ValueError(f"a cluster needs at least one broker, not {brokers}")
        self.workdir = Path(workdir).resolve()
        self.replication = min(brokers, MAX_REPLICATION)
        self.min_insync = max(1, self.replication - 1)
        cluster_id = new_cluster_id()
        # controller ports first: every node's configuration names every voter
        ports = {i: free_port() for i in range(1, brokers + 1)}
        voters = ",".join(f"{i}@{LOCALHOST}:{port}" for i, port in ports.items())
        self.nodes: dict[int, LocalKafkaBroker] = {
            i: LocalKafkaBroker(
                self.workdir / f"node-{i}", heap, detached=detached, controller_port=port,
                layout=NodeLayout(i, voters, cluster_id, self.replication, self.min_insync),
            )
            for i, port in ports.items()
        }
        self.startup_seconds: float | None = None

    @property
    def bootstrap(self) -> str:
        """Every node's PLAINTEXT address, comma-separated (a client needs only one to answer)."""
        return ",".join(node.bootstrap for node in self.nodes.values())

    def node(self, node_id: int) -> LocalKafkaBroker:
        try:
            return self.nodes[node_id]
        except KeyError:
            raise KeyError(f"no node {node_id} in this cluster (nodes {sorted(self.nodes)})") from None

    def start(self, timeout: float | None = None) -> str:
        """Start every node and block until each serves metadata; return `bootstrap`.

        The nodes start together (one alone cannot elect a controller). Raises BrokerStartError
        naming the node, and stops every node, when one exits or is not ready in time.
        """
        began = time.monotonic()
        deadline = began + (self.START_TIMEOUT if timeout is None else timeout)
        try:
            offsets = {i: node.launch() for i, node in self.nodes.items()}
            for i, node in self.nodes.items():
                node.wait_ready(offsets[i], began, deadline)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        logger.info("kafka cluster of %d nodes ready at %s in %.2fs", len(self.nodes), self.bootstrap,
                    self.startup_seconds)
        return self.bootstrap

    def stop(self, timeout: float = 20.0) -> None:
        """Stop every node (SIGTERM to all at once, SIGKILL to any left after `timeout`).

        All at once: stopped one by one, the last nodes lose their quorum and wait for a
        controller that will not come back before they finish shutting down.
        """
        for node in self.nodes.values():
            node.resume()
            node.terminate()
        deadline = time.monotonic() + timeout
        for node in self.nodes.values():
            node.stop(max(0.1, deadline - time.monotonic()))

    def kill(self) -> None:
        """SIGKILL every node: the end of a cluster whose data nobody keeps (a test's), without
        the wait for shutdowns that cannot reach a quorum."""
        for node_id in self.nodes:
            self.kill_node(node_id)

    def start_node(self, node_id: int, timeout: float | None = None) -> None:
        """Start one stopped or killed node again (same ports and data) and wait until it serves."""
        self.node(node_id).start(self.START_TIMEOUT if timeout is None else timeout)

    def stop_node(self, node_id: int, timeout: float | None = None) -> None:
        """A clean shutdown of one node (its partitions' leadership moves first)."""
        node = self.node(node_id)
        node.resume()
        node.stop(timeout)

    def kill_node(self, node_id: int) -> None:
        """SIGKILL one node, as a crash or a power cut would."""
        node = self.node(node_id)
        node.resume()  # a stopped process dies on SIGKILL too, but be plain about it
        node.kill()

    def restart_node(self, node_id: int, timeout: float | None = None) -> None:
        """Clean stop and start of one node (one step of a rolling restart)."""
        self.stop_node(node_id)
        self.start_node(node_id, timeout)

    def pause_node(self, node_id: int) -> None:
        """Freeze one node (SIGSTOP): it answers nothing, its sockets stay open."""
        node = self.node(node_id)
        if node.pid is None:
            raise BrokerStartError(f"kafka node {node_id} is not running")
        node.pause()

    def resume_node(self, node_id: int) -> None:
        """Let a paused node run again (SIGCONT)."""
        self.node(node_id).resume()

    def running_nodes(self) -> list[int]:
        return [i for i, node in self.nodes.items() if node.is_running()]

    def active_controller(self) -> int | None:
        """The node id of the quorum leader (the active controller), as the running nodes
        recorded it in their `quorum-state` files; the highest epoch wins. None if unknown."""
        best: tuple[int, int] | None = None
        for i in self.running_nodes():
            # KRaft writes it on every election
            path = self.nodes[i].workdir / "data" / "__cluster_metadata-0" / "quorum-state"
            try:
                state = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            leader, epoch = int(state.get("leaderId", -1)), int(state.get("leaderEpoch", -1))
            if leader >= 0 and (best is None or epoch > best[1]):
                best = (leader, epoch)
        return None if best is None else best[0]

    def __enter__(self) -> LocalKafkaCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

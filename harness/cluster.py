"""Faults on a replicated cluster (``rollstream.dev.cluster``: local KRaft nodes, every node a
controller voter, topics and internal topics at replication 3 with ``min.insync.replicas`` 2):
finding whom to kill.

:class:`ClusterProbe` answers the questions a fault schedule asks: which node leads a partition,
which node is the transaction coordinator of a transactional id (FindCoordinator), which node is
the active controller, and whether every partition (internal ones included) is fully
replicated again after a node came back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
from aiokafka.errors import KafkaError

from rollstream.config import KafkaConfig
from rollstream.dev.cluster import LocalKafkaCluster
from rollstream.kafka.clients import make_admin


log = logging.getLogger(__name__)

TRANSACTION_COORDINATOR = 1  # FindCoordinator key type of a transactional id
PROBE_TIMEOUT_MS = 3000


@dataclass
class FaultRecord:
    """One fault as it happened: what, on which node, at what progress, how long to recover."""

    kind: str
    node: int | None
    progress: float
    seconds: float = 0.0
    detail: str = ""

    def line(self) -> str:
        where = f" node {self.node}" if self.node is not None else ""
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.kind}{where} at {self.progress:.0%}, recovered in {self.seconds:.1f}s{extra}"


class ClusterProbe:
    """Questions about the cluster's current roles, asked with a fresh admin client each time
    (a client that talked to a killed node carries nothing over)."""

    def __init__(self, cluster: LocalKafkaCluster, kafka: KafkaConfig,
                 say: Callable[[str], None] = log.info) -> None:
        self.cluster = cluster
        # short requests: a question sent to a paused node must not wait the tiers' 40 s
        self.kafka = msgspec.structs.replace(kafka, request_timeout_ms=PROBE_TIMEOUT_MS)
        self.say = say  # where a long wait reports what it still waits for

    async def _ask(self, what: str, fn, timeout: float = 60.0):  # type: ignore[no-untyped-def]
        """``fn(admin)`` with a fresh admin client, asked again until it answers; each try, the
        client's start and close included, is bounded by what is left of ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    return await self._ask_once(fn)
            except (KafkaError, OSError, TimeoutError, LookupError) as exc:
                if time.monotonic() >= deadline:
                    raise AssertionError(f"could not find {what} in {timeout:.0f}s: {exc!r}") from exc
            await asyncio.sleep(0.5)

    async def _ask_once(self, fn):  # type: ignore[no-untyped-def]
        admin = make_admin(self.kafka, "fault-probe")
        try:
            await admin.start()
            return await fn(admin)
        finally:
            await admin.close()

    async def leader(self, topic: str, partition: int) -> int:
        """The node that leads ``topic``/``partition`` now."""
        async def ask(admin) -> int:  # type: ignore[no-untyped-def]
            for entry in await admin.describe_topics([topic]):
                for part in entry["partitions"]:
                    if part["partition"] == partition and part["leader"] >= 0:
                        return int(part["leader"])
            raise LookupError(f"no leader for {topic}[{partition}] yet")

        return int(await self._ask(f"the leader of {topic}[{partition}]", ask))

    async def transaction_coordinator(self, transactional_id: str) -> int:
        """The node whose transaction coordinator owns ``transactional_id`` (FindCoordinator)."""
        async def ask(admin) -> int:  # type: ignore[no-untyped-def]
            return int(await admin.find_coordinator(transactional_id, TRANSACTION_COORDINATOR))

        return int(await self._ask(f"the transaction coordinator of {transactional_id}", ask))

    async def active_controller(self, timeout: float = 30.0) -> int:
        """The quorum leader, from the nodes' own records of the latest election."""
        deadline = time.monotonic() + timeout
        while (node := self.cluster.active_controller()) is None:
            if time.monotonic() > deadline:
                raise AssertionError("no node recorded an active controller")
            await asyncio.sleep(0.5)
        return node

    async def under_replicated(self) -> list[str]:
        """Partitions (internal topics too) without a leader or with a replica out of the ISR."""
        async def ask(admin) -> list[str]:  # type: ignore[no-untyped-def]
            brokers = len((await admin.describe_cluster())["brokers"])
            if brokers < len(self.cluster.nodes):
                return [f"{brokers} of {len(self.cluster.nodes)} brokers registered"]
            return [
                f"{entry['topic']}[{part['partition']}] isr {part['isr']} of {part['replicas']}"
                for entry in await admin.describe_topics()
                for part in entry["partitions"]
                if part["leader"] < 0 or len(part["isr"]) < len(part["replicas"])
            ]

        return list(await self._ask("the replication state", ask))

    async def wait_fully_replicated(self, timeout: float = 120.0) -> float:
        """Wait until every partition has its full ISR again (saying every 15 s what still lags);
        returns the seconds waited. The whole wait, its questions included, ends by ``timeout``."""
        began = time.monotonic()
        said = began
        lagging = ["(not asked yet)"]
        try:
            async with asyncio.timeout(timeout):
                while lagging := await self.under_replicated():
                    if time.monotonic() - said >= 15:
                        said = time.monotonic()
                        self.say(f"full ISR: {len(lagging)} still lagging after {said - began:.0f}s, "
                                 f"e.g. {lagging[:3]}")
                    await asyncio.sleep(0.5)
        except (TimeoutError, AssertionError) as exc:
            raise AssertionError(f"still under-replicated after {time.monotonic() - began:.0f}s (of {timeout:.0f}s): "
                                 f"{lagging[:8]} ({exc!r})") from None
        return time.monotonic() - began


def node_logs(cluster: LocalKafkaCluster) -> dict[int, Path]:
    return {i: node.log_path for i, node in cluster.nodes.items()}

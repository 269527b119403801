"""Kafka's own command-line tools, run from the cached broker jars (a JVM start each).

``topic_bytes`` (``LogDirsCommand``) and ``end_offsets`` (``GetOffsetShell``) measure what a run
wrote; ``wait_for_groups`` (``ConsumerGroupCommand``) confirms consumers hold partitions, since
aiokafka 0.14 cannot decode a Kafka 4 DescribeGroups answer.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

from rollstream.dev.kafka_jars import classpath, ensure_kafka_jars, java_executable


def kafka_tool(main_class: str, *args: str, timeout: float = 300.0) -> str:
    """Run a Kafka tool class from the cached jars; its stdout (raises with stderr on failure)."""
    libs = ensure_kafka_jars()
    argv = [java_executable(), "-Xmx256m", "-XX:+UseSerialGC", "-cp", classpath(libs), main_class, *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{main_class} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def topic_bytes(bootstrap: str, topics: list[str]) -> dict[str, int]:
    """Bytes in each topic's log on the broker (all partitions), via ``LogDirsCommand``."""
    out = kafka_tool("org.apache.kafka.tools.LogDirsCommand", "--bootstrap-server", bootstrap,
                     "--describe", "--topic-list", ",".join(topics))
    line = next(l for l in out.splitlines() if l.startswith("{"))
    sizes = {t: 0 for t in topics}
    for broker in json.loads(line)["brokers"]:
        for log_dir in broker["logDirs"]:
            for part in log_dir["partitions"]:
                topic = part["partition"].rsplit("-", 1)[0]
                if topic in sizes:
                    sizes[topic] += int(part["size"])
    return sizes


def end_offsets(bootstrap: str) -> dict[str, int]:
    """Sum of end offsets per topic, internal topics included (Kafka's ``GetOffsetShell``).

    The growth of ``__transaction_state`` counts transaction state changes, that of
    ``__consumer_offsets`` counts offset commits (and group changes), that of a data topic its
    records plus transaction markers.
    """
    out = kafka_tool("org.apache.kafka.tools.GetOffsetShell", "--bootstrap-server", bootstrap)
    sums: dict[str, int] = {}
    for line in out.splitlines():  # topic:partition:offset
        topic, _partition, offset = (line.rsplit(":", 2) + ["", ""])[:3]
        if topic and offset.strip().isdigit():
            sums[topic] = sums.get(topic, 0) + int(offset)
    return sums


def assigned_groups(bootstrap: str, group_ids: list[str]) -> set[str]:
    """The groups in ``group_ids`` with a member that holds partitions (Kafka's group tool;
    aiokafka 0.14 cannot decode a Kafka 4 DescribeGroups answer)."""
    args = ["--bootstrap-server", bootstrap, "--describe", "--members"]
    for group in group_ids:
        args += ["--group", group]
    try:
        out = kafka_tool("org.apache.kafka.tools.consumer.group.ConsumerGroupCommand", *args, timeout=60)
    except RuntimeError:
        return set()  # e.g. a group that does not exist yet
    ready = set()
    for line in out.splitlines():
        parts = line.split()
        # GROUP CONSUMER-ID HOST CLIENT-ID #PARTITIONS
        if len(parts) >= 5 and parts[0] in group_ids and parts[-1].isdigit() and int(parts[-1]) > 0:
            ready.add(parts[0])
    return ready


async def wait_for_groups(bootstrap: str, group_ids: list[str], timeout: float) -> None:
    """Return once every consumer group in ``group_ids`` has a member holding partitions."""
    deadline = time.monotonic() + timeout
    while True:
        ready = await asyncio.to_thread(assigned_groups, bootstrap, group_ids)
        if ready >= set(group_ids):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"consumer groups not ready after {timeout:.0f}s: {sorted(set(group_ids) - ready)}")
        await asyncio.sleep(1.0)

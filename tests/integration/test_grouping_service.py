"""The grouping service against a real broker and Redis: one record per task, exactly once,
through bad input, a SIGKILL with half-open groups, and a rebalance between two instances."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgspec
import pytest
import yaml
from aiokafka.admin import NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from harness.configs import make_config
from harness.episodes import failed, rejected, scored
from harness.scored_feed import WAIT_S, group_messages, read_all, write_scored
from harness.tiers import TierProcess
from rollstream.api.engine import WeightUpdate
from rollstream.config import RollstreamConfig
from rollstream.consumers.grouping.service import run
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_admin
from rollstream.state.budget import RebuiltCounts, StalenessBudget
from rollstream.state.client import RedisKeys
from rollstream.state.version_store import VersionStore
from rollstream.wire import EmittedGroup, GroupDropped, decode_group, decode_dead_letter, decode_outcome
from rollstream.wire.torch_tensors import group_tensors
from rollstream.kafka.topics import TopicNames


pytestmark = pytest.mark.broker

GROUPING = {"commit_interval_ms": 100, "session_timeout_ms": 6000, "group_timeout_seconds": 60}
def outcome_per_task(records: list) -> dict[str, list[str]]:
    """task -> every outcome recorded for it ("batch" or the drop reason)."""
    seen: dict[str, list[str]] = {}
    for record in records:
        message = decode_group(record.value)
        if isinstance(message, EmittedGroup):
            seen.setdefault(message.task_id, []).append("batch")
        else:
            seen.setdefault(message.task_id, []).append(message.reason)
    return seen


async def test_groups_drops_and_dead_letters(kafka_bootstrap: str, redis_url: str, unique_name: str, redis_client) -> None:
    config = make_config(kafka_bootstrap, redis_url, unique_name, {"grouping": {**GROUPING, "group_timeout_seconds": 4}})
    names = TopicNames.of(config)
    keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
    await VersionStore(redis_client, keys).publish(WeightUpdate(3, "/weights/3"))
    budget = StalenessBudget(redis_client, keys, 0, 1)
    await budget.restore(RebuiltCounts())  # a fresh trial's counters (producers write them in a pipeline)
    await ensure_topics(config.kafka, names)
    items: list[tuple[msgspec.Struct | bytes, int]] = []
    for t in range(6):  # complete groups, samples shuffled and one duplicated
        msgs = group_messages(f"ok{t}")
        items += [(m, t % 2) for m in [msgs[2], msgs[0], msgs[0], msgs[3], msgs[1]]]
    items += [(rejected("rej", i), 0) for i in range(4)]
    items += [(scored("fail", 0), 1), (failed("fail"), 1)]
    items += [(scored("mixed", 0), 0), (rejected("mixed", 1), 0), (scored("mixed", 2, reward=0.0), 0), (rejected("mixed", 3), 0)]
    items += [(scored("late", 0), 1)]  # never completes: times out
    items += [(b"\xff\x00 not a message", 1), (scored("late", 1, group_size=2), 1)]  # garbage, conflict
    await write_scored(config, items)

    stop = asyncio.Event()
    service = asyncio.create_task(run(config, stop))
    try:
        records = await read_all(config, names.batches, until=11)
        letters = await read_all(config, names.dead_letter, until=2, settle_s=0.5)
    finally:
        stop.set()
        await asyncio.wait_for(service, 60)

    seen = outcome_per_task(records)
    expected = {f"ok{t}": ["batch"] for t in range(6)}
    expected |= {"rej": ["all_rejected"], "fail": ["task_failed"], "mixed": ["batch"], "late": ["timeout"]}
    expected |= {"junk": ["task_failed"]}  # undecodable: its key's group is told at once
    assert seen == expected
    batches = [decode_group(r.value) for r in records]
    for batch in (b for b in batches if isinstance(b, EmittedGroup)):
        tensors = group_tensors(batch)
        assert batch.trainer_version == 3 and batch.packed.keys
        if batch.task_id == "mixed":  # two accepted samples of 2 prompt + 3 generated tokens
            assert tensors["input_ids"].shape == (2, 5) and batch.sample_idx == [0, 2]
            assert tensors["rewards"].tolist() == [1.0, 0.0]
            assert (batch.head_version, batch.staleness) == (0, 3)
            continue
        assert tensors["input_ids"].shape == (4, 6)  # prompt 2 + longest generation 4
        assert tensors["versions"][0].tolist() == [-1, -1, 1, -1, -1, -1]  # padding is -1
        assert tensors["attention_mask"][0].tolist() == [True] * 3 + [False] * 3
        assert batch.sample_idx == [0, 1, 2, 3] and tensors["rewards"].tolist() == [0.0, 1.0, 0.0, 1.0]
        assert (batch.head_version, batch.tail_version, batch.staleness) == (1, 1, 2)
    assert all(isinstance(b, GroupDropped) and b.trainer_version == 3 for b in batches if not isinstance(b, EmittedGroup))
    reasons = sorted(decode_dead_letter(r.value).reason for r in letters)
    assert len(reasons) == 2 and "group_size 2" in reasons[0] + reasons[1]
    assert await budget.drops_by_reason() == {"all_rejected": 1, "task_failed": 2, "timeout": 1}


async def test_a_record_per_group_and_tombstones(
    kafka_bootstrap: str, redis_url: str, unique_name: str
) -> None:
    """Every complete group is its own batch record, eval ones too; with a zero dedupe window
    every outcome is tombstoned once the committed offset has passed its group."""
    sections = {"grouping": {**GROUPING, "dedupe_window_seconds": 0}}
    config = make_config(kafka_bootstrap, redis_url, unique_name, sections)
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    items = [(m, 0) for t in range(4) for m in group_messages(f"b{t}", size=2)]
    items += [(scored("ev", i, 2, is_eval=True), 1) for i in range(2)]
    await write_scored(config, items)
    stop = asyncio.Event()
    service = asyncio.create_task(run(config, stop))
    try:
        records = await read_all(config, names.batches, until=5)
        changelog = await read_all(config, names.grouping_changelog, until=10, settle_s=0.5)
    finally:
        stop.set()
        await asyncio.wait_for(service, 60)
    batches = sorted((decode_group(r.value) for r in records), key=lambda b: b.task_id)
    assert [(b.task_id, b.is_eval) for b in batches] == [("b0", False), ("b1", False), ("b2", False), ("b3", False),
                                                           ("ev", True)]
    assert group_tensors(batches[0])["input_ids"].shape == (2, 4) and batches[0].sample_idx == [0, 1]
    history: dict[str, list[str]] = {}
    for record in changelog:
        outcome = "tombstone" if record.value is None else decode_outcome(record.value).outcome
        history.setdefault(record.key.decode(), []).append(outcome)
    assert history == {t: ["emitted", "tombstone"] for t in ("b0", "b1", "b2", "b3", "ev")}


def write_config_file(config: RollstreamConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(msgspec.to_builtins(config)))
    return path


def grouping_process(config: RollstreamConfig, tmp_path: Path) -> TierProcess:
    """``rollstream grouping`` on ``config`` as the instance ``g-crash``, not started yet."""
    config_file = write_config_file(config, tmp_path / "grouping.yaml")
    return TierProcess("grouping", config_file, tmp_path / "grouping.log", overrides=["grouping.instance_id=g-crash"])


async def test_sigkill_with_half_open_groups_is_exactly_once(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    config = make_config(kafka_bootstrap, redis_url, unique_name, {"grouping": GROUPING})
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    tasks = [f"g{t}" for t in range(6)]
    groups = {t: group_messages(t) for t in tasks}
    first = [(m, i % 2) for i, t in enumerate(tasks) for m in groups[t][:2]]
    first += [(m, p) for p in (0, 1) for m in group_messages(f"mark{p}")]  # proves the halves were read
    await write_scored(config, first)
    grouping = grouping_process(config, tmp_path).start()
    try:
        await read_all(config, names.batches, until=2, settle_s=0.5)
        await asyncio.sleep(0.5)
        grouping.kill()
        await write_scored(config, [(m, i % 2) for i, t in enumerate(tasks) for m in groups[t][2:]])
        grouping.start()
        records = await read_all(config, names.batches, until=len(tasks) + 2, settle_s=3.0)
    finally:
        code = grouping.stop(30)
    assert code == 0, grouping.tail()
    seen = outcome_per_task(records)
    assert seen == {t: ["batch"] for t in tasks + ["mark0", "mark1"]}, grouping.tail()


async def test_sigkill_mid_stream_is_exactly_once(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    """Samples keep arriving while the instance is killed (likely inside a transaction)."""
    config = make_config(kafka_bootstrap, redis_url, unique_name, {"grouping": GROUPING})
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    tasks = [f"s{t}" for t in range(24)]
    order = [(m, i % 2) for k in range(4) for i, t in enumerate(tasks) for m in group_messages(t)[k : k + 1]]
    grouping = grouping_process(config, tmp_path).start()
    try:
        for start in range(0, len(order), 8):
            await write_scored(config, order[start : start + 8])
            if start == 48:
                await asyncio.sleep(1.0)
                grouping.kill()
                grouping.start()
        records = await read_all(config, names.batches, until=len(tasks), settle_s=3.0)
    finally:
        grouping.stop(30)
    assert outcome_per_task(records) == {t: ["batch"] for t in tasks}, grouping.tail()


async def test_failed_transaction_is_aborted_and_rebuilt(
    kafka_bootstrap: str, redis_url: str, unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker refuses a batch (too large for the topic): the transaction aborts, state is
    rebuilt from the committed offsets, and once the topic allows it every group is emitted once."""
    caplog.set_level(logging.INFO, logger="rollstream.kafka.transactions")
    config = make_config(kafka_bootstrap, redis_url, unique_name, {"grouping": GROUPING})
    names = TopicNames.of(config)
    admin = make_admin(config.kafka)
    await admin.start()
    try:
        small = {"max.message.bytes": "20000"}
        await admin.create_topics([NewTopic(names.batches, 2, 1, topic_configs=small)])
        await ensure_topics(config.kafka, names)
        items = [(m, 0) for t in ("a", "b") for m in group_messages(t, size=2)]
        items += [(scored("big", i, 2, reward=float(i), gen_len=4000), 0) for i in range(2)]
        items += [(m, p) for p, t in ((0, "c"), (1, "d")) for m in group_messages(t, size=2)]
        await write_scored(config, items)
        stop = asyncio.Event()
        service = asyncio.create_task(run(config, stop))
        try:
            await wait_for_log(caplog, "failed (MessageSizeTooLargeError")
            resource = ConfigResource(ConfigResourceType.TOPIC, names.batches, configs={"max.message.bytes": "1048576"})
            await admin.alter_configs([resource])
            records = await read_all(config, names.batches, until=5, settle_s=2.0)
        finally:
            stop.set()
            await asyncio.wait_for(service, 60)
    finally:
        await admin.close()
    assert outcome_per_task(records) == {t: ["batch"] for t in ("a", "b", "big", "c", "d")}


async def wait_for_log(caplog: pytest.LogCaptureFixture, text: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not any(text in m for m in caplog.messages):
        if loop.time() > deadline:
            pytest.fail(f"no log line with {text!r}")
        await asyncio.sleep(0.1)


async def test_rebalance_between_two_instances_is_exactly_once(
    kafka_bootstrap: str, redis_url: str, unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rollstream.consumers.grouping.transform")
    configs = [
        make_config(kafka_bootstrap, redis_url, unique_name, {"grouping": {**GROUPING, "instance_id": name}})
        for name in ("g-a", "g-b")
    ]
    names = TopicNames.of(configs[0])
    await ensure_topics(configs[0].kafka, names)
    tasks = [f"r{t}" for t in range(8)]
    groups = {t: group_messages(t, size=4 if i < 4 else 2) for i, t in enumerate(tasks)}

    def part(k: int) -> list[tuple[msgspec.Struct, int]]:
        """Sample k of every group (groups of 2 complete at k=1, while both instances run)."""
        return [(groups[t][k], i % 2) for i, t in enumerate(tasks) if k < len(groups[t])]

    stops = [asyncio.Event(), asyncio.Event()]
    a = asyncio.create_task(run(configs[0], stops[0]))
    b: asyncio.Task[None] | None = None
    try:
        await write_scored(configs[0], part(0))
        await asyncio.sleep(3)
        b = asyncio.create_task(run(configs[1], stops[1]))  # joins: partitions move mid-groups
        await asyncio.sleep(4)
        await write_scored(configs[0], part(1))
        await asyncio.sleep(2)
        await write_scored(configs[0], part(2))
        stops[1].set()  # leaves mid-run: its partitions go back to the first instance
        await asyncio.wait_for(b, 60)
        await write_scored(configs[0], part(3))
        records = await read_all(configs[0], names.batches, until=len(tasks), settle_s=3.0)
    finally:
        for stop in stops:
            stop.set()
        await asyncio.wait_for(a, 60)
        if b is not None and not b.done():
            await asyncio.wait_for(b, 60)
    assert outcome_per_task(records) == {t: ["batch"] for t in tasks}
    emitters = {m.split(":")[0] for m in caplog.messages if ": emitted group " in m}
    assert emitters == {"g-a", "g-b"}, "both instances should have owned partitions with groups"

"""Debugging tools against the real broker and Redis: replay, tail, status, dump service, metrics."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from aiokafka import TopicPartition

from harness.configs import make_config
from harness.fakes import make_tokenizer
from harness.trajectories import multi_turn, scored, single_turn
from harness.waits import eventually
from rollstream.api.engine import WeightUpdate
from rollstream.config import RollstreamConfig
from rollstream.consumers.dump import service as dump_service
from rollstream.dump.lines import dump_record, read_task
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.admin import topic_partitions
from rollstream.kafka.clients import make_admin, make_consumer, make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.runtime.metrics import serve_metrics
from rollstream.state.client import RedisKeys, connect
from rollstream.state.version_store import VersionStore
from rollstream.tools.positions import ALL_PARTITIONS
from rollstream.tools.replay import ReplayOptions, replay
from rollstream.tools.roles import topic_for
from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.wire import (
    EmittedGroup,
    Episode,
    GroupDropped,
    SampleRejected,
    ScoredEpisode,
    decode_dead_letter,
    decode_scored,
    encode,
)
from rollstream.wire.torch_tensors import group_tensors, decode_tensor, pack_tensor_dict


pytestmark = pytest.mark.broker

WAIT_S = 60.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture
def config(kafka_bootstrap: str, redis_url: str, unique_name: str, tokenizer_dir: str, tmp_path: Path) -> RollstreamConfig:
    return make_config(
        kafka_bootstrap, redis_url, unique_name,
        {"rollout": {"tokenizer_path": tokenizer_dir, "fileroot": str(tmp_path / "service-dumps")}},
    )



def sample_messages() -> list[ScoredEpisode]:
    """Two tasks of two samples each, at different versions, one multi-turn."""
    return [
        scored(single_turn("what is two plus two", "four <eos>", [1, 2]), 1.0, task_id="q/1", sample_idx=0),
        scored(single_turn("what is two plus two", "five <eos>", [2, 2]), 0.0, task_id="q/1", sample_idx=1),
        scored(multi_turn(), 0.5, task_id="q2", sample_idx=0),
        scored(single_turn("hello", "world <eos>", [3, 3]), 0.0, task_id="q2", sample_idx=1, is_eval=True),
    ]


async def publish(config: RollstreamConfig, role: str, values: list[tuple[bytes, bytes]]) -> None:
    """Send (key, value) records into ``role`` of ``config``'s experiment, in order."""
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    producer = make_producer(config.kafka, "test")
    await producer.start()
    try:
        for key, value in values:
            await producer.send_and_wait(topic_for(names, role), value, key=key)
    finally:
        await producer.stop()


async def publish_scored(config: RollstreamConfig) -> list[ScoredEpisode]:
    messages = sample_messages()
    records = [(m.episode.task_id.encode(), encode(m)) for m in messages]
    records.insert(2, (b"q/1", encode(SampleRejected(task_id="q/1", sample_idx=1, group_size=2))))
    records.append((b"bad", b"\xc1 not msgpack"))
    await publish(config, "scored", records)
    return messages


async def read_raw(config: RollstreamConfig, topic: str) -> list[tuple[int, bytes | None, bytes | None]]:
    """Every (partition, key, value) of ``topic`` up to its end, partition by partition."""
    consumer = make_consumer(config.kafka, "test-reader", group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in await topic_partitions(config.kafka, topic) or []]
        ends = await consumer.end_offsets(tps)
        found: list[tuple[int, bytes | None, bytes | None]] = []
        for tp in tps:
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            while await consumer.position(tp) < ends[tp]:
                for record in (await consumer.getmany(tp, timeout_ms=500)).get(tp, []):
                    found.append((record.partition, record.key, record.value))
        return found
    finally:
        await consumer.stop()


def read_dump(root: Path, config: RollstreamConfig) -> dict[tuple[str, int], dict[str, Any]]:
    base = root / config.experiment.experiment_name / config.experiment.trial_name
    lines = [json.loads(line) for path in sorted(base.rglob("*.jsonl")) for line in path.read_text().splitlines()]
    return {(line["task_id"], line["sample_idx"]): line for line in lines}


async def test_replay_scored_to_dump_matches_the_episodes(config: RollstreamConfig, tmp_path: Path) -> None:
    messages = await publish_scored(config)
    stats = await replay(config, "scored", ReplayOptions(to_dump=tmp_path / "dump"))
    assert stats.completed and stats.read == 6 and stats.undecodable == 1
    dumped = read_dump(tmp_path / "dump", config)
    tokenizer = make_tokenizer()
    assert len(dumped) == 4
    exp = config.experiment
    for message in messages:
        episode = message.episode
        expected = dump_record(message, tokenizer)
        assert dumped[(episode.task_id, episode.sample_idx)] == expected
        group = read_task(tmp_path / "dump", exp.experiment_name, exp.trial_name, episode.task_id, episode.is_eval)
        assert expected in group
    assert dumped[("q2", 0)]["prompt_len"] == 4 and dumped[("q2", 0)]["head_version"] == 3


async def test_replay_filters(config: RollstreamConfig, tmp_path: Path) -> None:
    await publish_scored(config)
    only_q2 = await replay(
        config, "scored", ReplayOptions(to_dump=tmp_path / "a", filter=_filter(task_ids=frozenset({"q2"}), is_eval=False))
    )
    assert only_q2.matched == 1 and set(read_dump(tmp_path / "a", config)) == {("q2", 0)}
    await replay(config, "scored", ReplayOptions(to_dump=tmp_path / "b", filter=_filter(min_reward=0.5)))
    assert set(read_dump(tmp_path / "b", config)) == {("q/1", 0), ("q2", 0)}
    await replay(config, "scored", ReplayOptions(to_dump=tmp_path / "c", filter=_filter(min_reward=0.5, max_version=4)))
    assert set(read_dump(tmp_path / "c", config)) == {("q/1", 0)}  # q2 sample 0 ends at version 5


def _filter(**kw: Any) -> Any:
    from rollstream.tools.filters import RecordFilter

    return RecordFilter(**kw)


async def test_replay_to_jsonl_twice_gives_identical_bytes(config: RollstreamConfig, tmp_path: Path) -> None:
    await publish_scored(config)
    await replay(config, "scored", ReplayOptions(to_jsonl=tmp_path / "one.jsonl"))
    await replay(config, "scored", ReplayOptions(to_jsonl=tmp_path / "two.jsonl"))
    one = (tmp_path / "one.jsonl").read_bytes()
    assert one == (tmp_path / "two.jsonl").read_bytes()
    lines = [json.loads(line) for line in one.splitlines()]
    assert len(lines) == 6
    assert [line["offset"] for line in lines if line["partition"] == 0] == sorted(
        line["offset"] for line in lines if line["partition"] == 0
    )
    assert [line["partition"] for line in lines] == sorted(line["partition"] for line in lines)
    assert sum("error" in line for line in lines) == 1
    kinds = sorted(line["message"]["kind"] for line in lines if "message" in line)
    assert kinds == ["rejected", "scored", "scored", "scored", "scored"]


async def test_replay_to_experiment_copies_records_byte_for_byte(config: RollstreamConfig, unique_name: str) -> None:
    await publish_scored(config)
    stats = await replay(config, "scored", ReplayOptions(to_experiment=f"{unique_name}-copy"))
    assert stats.written == 6
    source = await read_raw(config, TopicNames.of(config).scored)
    target = await read_raw(config, TopicNames(f"{unique_name}-copy", "t0").scored)
    assert target == source  # same partitions, keys and bytes, in order (the bad record too)


async def test_stop_and_resume_adds_up_to_one_run(config: RollstreamConfig, tmp_path: Path) -> None:
    await publish_scored(config)
    await replay(config, "scored", ReplayOptions(to_jsonl=tmp_path / "whole.jsonl"))
    resume = tmp_path / "resume.json"
    parts = tmp_path / "parts.jsonl"
    first = await replay(config, "scored", ReplayOptions(to_jsonl=parts, resume_file=resume, max_records=2))
    assert not first.completed and first.read == 2
    saved = json.loads(resume.read_text())["next"]
    assert sum(saved.values()) - sum(first.start.values()) == 2
    stop = asyncio.Event()

    def stop_after_one(stats: Any) -> None:
        stop.set()  # the replay finishes the record in hand, then stops

    second = await replay(
        config, "scored", ReplayOptions(to_jsonl=parts, resume_file=resume), stop=stop, progress=stop_after_one
    )
    assert not second.completed and second.read == 1
    third = await replay(config, "scored", ReplayOptions(to_jsonl=parts, resume_file=resume))
    assert third.completed and first.read + second.read + third.read == 6
    assert parts.read_bytes() == (tmp_path / "whole.jsonl").read_bytes()


async def test_replay_is_bounded_by_the_end_offsets_at_start(config: RollstreamConfig) -> None:
    await publish_scored(config)
    late: list[asyncio.Task[None]] = []

    def publish_more(stats: Any) -> None:  # records that arrive while the replay runs
        late.append(asyncio.ensure_future(publish(config, "scored", [(b"q9", b"late")] * 3)))

    stats = await replay(config, "scored", ReplayOptions(), on_start=publish_more)
    await late[0]
    assert stats.completed and stats.read == 6 and sum(stats.end.values()) == 6
    again = await replay(config, "scored", ReplayOptions())
    assert again.read == 9


async def test_replay_start_positions(config: RollstreamConfig) -> None:
    await publish_scored(config)
    whole = await replay(config, "scored", ReplayOptions())
    non_empty = sum(1 for p in whole.end if whole.end[p] > 0)
    skip_first = await replay(config, "scored", ReplayOptions(offsets={ALL_PARTITIONS: 1}))
    assert skip_first.read == 6 - non_empty
    busiest = max(whole.end, key=lambda p: whole.end[p])
    one = await replay(config, "scored", ReplayOptions(offsets={busiest: whole.end[busiest] - 1}))
    assert one.start[busiest] == whole.end[busiest] - 1
    assert one.read == 6 - whole.end[busiest] + 1
    future = await replay(config, "scored", ReplayOptions(since_ms=int(time.time() * 1000) + 3_600_000))
    assert future.read == 0 and future.completed
    past = await replay(config, "scored", ReplayOptions(since_ms=0))
    assert past.read == 6


def cli(config: RollstreamConfig, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    overrides = [
        f"kafka.bootstrap_servers={config.kafka.bootstrap_servers}", f"redis.url={config.redis.url}",
        f"experiment.experiment_name={config.experiment.experiment_name}", "experiment.trial_name=t0",
    ]
    argv = [sys.executable, "-m", "rollstream.cli", *args]
    for item in overrides:
        argv += ["--set", item]
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env, check=False)


async def test_tail_prints_summaries(config: RollstreamConfig) -> None:
    await publish_scored(config)
    done = await asyncio.to_thread(cli, config, "tail", "scored", "--from-beginning", "--max-messages", "6")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 6
    assert sum(" scored " in line for line in lines) == 4
    assert any("task=q2 sample=0/2 v=3..5 reward=0.5 stop=stop len=4+7" in line for line in lines)
    assert any("rejected" in line and "task=q/1" in line for line in lines)
    assert any(line.startswith("undecodable") for line in lines)


async def test_tail_stop_at_end_prints_what_there_is_and_exits(config: RollstreamConfig) -> None:
    await publish_scored(config)
    started = time.monotonic()
    done = await asyncio.to_thread(cli, config, "tail", "scored", "--from-beginning", "--stop-at-end", "--max-messages", "50")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 6 and time.monotonic() - started < 30
    helped = await asyncio.to_thread(cli, config, "tail", "--help")
    assert "--stop-at-end" in helped.stdout and "exit once every message that existed at start" in " ".join(helped.stdout.split())


async def test_status_in_flight_is_admitted_minus_emitted_minus_dropped(config: RollstreamConfig) -> None:
    from rollstream.state.budget import RebuiltCounts, StalenessBudget

    rows = [single_turn("what is two plus two", "four <eos>", [1, 2])] * 4
    records = [(b"a", encode(recorded_batch("a", rows[:2]))), (b"b", encode(recorded_batch("b", rows[2:]))),
               (b"e", encode(msgspec.structs.replace(recorded_batch("e", rows[:1]), is_eval=True))),
               (b"c", encode(GroupDropped(task_id="c", reason="all_failed")))]
    await publish(config, "batches", records)
    client = connect(config.redis)
    exp = config.experiment
    budget = StalenessBudget(client, RedisKeys(exp.experiment_name, exp.trial_name), 4, 8)
    await budget.restore(RebuiltCounts())  # a fresh trial's counters, as a producer writes them first
    for task in ("a", "b", "c", "d", "f"):
        assert await budget.try_admit(task)
    await budget.release("c", "all_failed")
    await client.aclose()
    done = await asyncio.to_thread(cli, config, "status", "--once")
    assert done.returncode == 0, done.stderr
    table = done.stdout.split("trainer version and staleness budget")[1]
    header = next(line for line in table.splitlines() if "in flight" in line)
    values = next(line for line in table.splitlines() if line.count("│") > 3 and "version" not in line)
    columns = dict(zip([c.strip() for c in header.split("┃")], [c.strip() for c in values.split("│")]))
    assert (columns["admitted"], columns["emitted"], columns["dropped"], columns["in flight"]) == ("5", "2", "1", "2")


async def test_status_once_shows_offsets_and_version(config: RollstreamConfig) -> None:
    await publish_scored(config)
    client = connect(config.redis)
    exp = config.experiment
    await VersionStore(client, RedisKeys(exp.experiment_name, exp.trial_name)).publish(WeightUpdate(3, "/weights/v3"))
    await client.aclose()
    done = await asyncio.to_thread(cli, config, "status", "--once")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    scored_row = next(line for line in out.splitlines() if TopicNames.of(config).scored in line and "scored" in line.split()[1:3])
    assert " 6 " in scored_row
    assert "consumer groups" in out and TopicNames.of(config).group_id("dump") in out
    version_row = out.split("trainer version and staleness budget")[1].splitlines()
    assert any(line.split("│")[1].strip() == "3" for line in version_row if line.count("│") > 3)
    assert "reward by tail version" in out


async def test_dump_service_writes_the_layout_and_serves_metrics(config: RollstreamConfig) -> None:
    messages = await publish_scored(config)
    stop = asyncio.Event()
    service = asyncio.create_task(dump_service.run(config, stop))
    root = Path(config.rollout.fileroot)
    exp = config.experiment

    async def all_dumped() -> bool:
        if service.done():
            service.result()
        return len(read_dump(root, config)) == 4 if root.exists() else False

    try:
        await eventually(all_dumped, "the dump service to write 4 lines")
        names = TopicNames.of(config)

        async def committed() -> bool:
            admin = make_admin(config.kafka, "test")
            await admin.start()
            try:
                offsets = await admin.list_consumer_group_offsets(names.group_id("dump"))
            finally:
                await admin.close()
            return sum(meta.offset for meta in offsets.values()) == 6

        await eventually(committed, "the dump group to commit every offset")
    finally:
        stop.set()
        await asyncio.wait_for(service, WAIT_S)
    tokenizer = make_tokenizer()
    for message in messages:
        expected = dump_record(message, tokenizer)
        group = read_task(root, exp.experiment_name, exp.trial_name, message.episode.task_id, message.episode.is_eval)
        assert expected in group
    letters = [decode_dead_letter(value) for _, _, value in await read_raw(config, TopicNames.of(config).dead_letter)]
    assert [(letter.tier, letter.source_topic, letter.key) for letter in letters] == [("dump", TopicNames.of(config).scored, b"bad")]
    await assert_metrics_served()


async def assert_metrics_served() -> None:
    """GET /metrics from serve_metrics: every pipeline metric is exported, the dump's with values."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve_metrics(port)

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return response.read().decode()

    text = await asyncio.to_thread(get)
    for name in (
        "rollstream_messages_in_total", "rollstream_messages_out_total", "rollstream_episodes_total",
        "rollstream_generated_tokens_total", "rollstream_reward", "rollstream_staleness_versions",
        "rollstream_group_completion_seconds", "rollstream_dead_letters_total", "rollstream_engine_request_seconds",
    ):
        assert f"# TYPE {name} " in text, name
    assert 'rollstream_dead_letters_total{reason="undecodable",tier="dump"}' in text
    assert 'rollstream_episodes_total{outcome="dumped",tier="dump"}' in text


async def test_replayed_episodes_rescored_in_another_experiment(
    config: RollstreamConfig, unique_name: str, tokenizer_dir: str, tmp_path: Path
) -> None:
    from rollstream.reward_workers import service as reward_service

    originals = [
        episode_of(single_turn("what is two plus two", "four <eos>", [1, 1]), "r1", 0),
        episode_of(single_turn("what is two plus two", "five <eos>", [1, 2]), "r1", 1),
        episode_of(multi_turn(), "r2", 0),
    ]
    await publish(config, "episodes", [(e.task_id.encode(), encode(e)) for e in originals])
    copied = await replay(config, "episodes", ReplayOptions(to_experiment=f"{unique_name}-rescore"))
    assert copied.written == 3
    rescoring = make_config(
        config.kafka.bootstrap_servers, config.redis.url, f"{unique_name}-rescore",
        {"reward": {"reward_fn": "tests.unit.reward_fns:prompt_echo", "tokenizer_path": tokenizer_dir,
                    "max_workers": 1, "worker_id": "rescore-0", "session_timeout_ms": 6000}},
    )
    stop = asyncio.Event()
    worker = asyncio.create_task(reward_service.run(rescoring, stop))
    try:
        async def all_scored() -> bool:
            if worker.done():
                worker.result()
            return len(await read_raw(rescoring, TopicNames.of(rescoring).scored)) == 3

        await eventually(all_scored, "the reward worker of the new experiment to score 3 episodes")
    finally:
        stop.set()
        await asyncio.wait_for(worker, WAIT_S)
    await replay(rescoring, "scored", ReplayOptions(to_dump=tmp_path / "after"))
    after = read_dump(tmp_path / "after", rescoring)
    tokenizer = make_tokenizer()
    for original in originals:
        line = after[(original.task_id, original.sample_idx)]
        before = dump_record(original, tokenizer)
        # the same trajectory, a new reward: prompt_echo scores the prompt's token count
        assert {k: v for k, v in line.items() if k != "reward"} == {k: v for k, v in before.items() if k != "reward"}
        assert line["reward"] == float(before["prompt_len"])
    for _, _, value in await read_raw(rescoring, TopicNames.of(rescoring).scored):
        message = decode_scored(value)
        assert isinstance(message, ScoredEpisode)
        original = next(e for e in originals if (e.task_id, e.sample_idx) == (message.episode.task_id, message.episode.sample_idx))
        for key, wire in original.trajectory.items():
            if key != "rewards":  # the one thing re-scoring changes
                assert bytes(message.episode.trajectory[key].data) == bytes(wire.data), key
        assert float(decode_tensor(message.episode.trajectory["rewards"])[0]) == message.reward


def episode_of(tensors: dict[str, Any], task_id: str, sample_idx: int) -> Episode:
    base = scored(tensors, 0.0, task_id=task_id, sample_idx=sample_idx).episode
    return msgspec.structs.replace(base, data={"answer": "four"})


async def test_replayed_batches_read_by_a_trainer_bit_for_bit(config: RollstreamConfig, unique_name: str) -> None:
    from rollstream.trainer import StepStream

    records = [
        recorded_batch("b1", [single_turn("hello", "world <eos>", [3, 4], 1.0), multi_turn()]),
        recorded_batch("b2", [single_turn("hello", "world <eos>", [3, 4], 1.0), multi_turn()]),
        recorded_batch("b3", [single_turn("what is two", "four", [4], 0.5), single_turn("two", "five five", [2, 4], 0.0)]),
    ]
    dropped = GroupDropped(task_id="b4", reason="stale", trainer_version=6)
    values = [(b.task_id.encode(), encode(b)) for b in records] + [(b"b4", encode(dropped))]
    await publish(config, "batches", values)
    await replay(config, "batches", ReplayOptions(to_experiment=f"{unique_name}-train"))
    trainer = make_config(
        config.kafka.bootstrap_servers, config.redis.url, f"{unique_name}-train",
        # recorded groups replayed: trained as they are, however many versions behind
        {"staleness": {"groups_per_step": 1}, "trainer": {"group_id": f"{unique_name}-trainer", "drop_stale": False}},
    )
    expected = {batch.task_id: group_tensors(batch) for batch in records}
    async with StepStream(trainer, ledger=False) as consumer:
        seen: dict[str, dict[str, torch.Tensor]] = {}
        for _ in range(len(expected)):
            batch = await consumer.next_step(timeout=WAIT_S)
            assert batch is not None and len(batch.task_ids) == 1
            seen[batch.task_ids[0]] = batch.tensors
            assert await consumer.ack(batch)
        assert await consumer.next_step(timeout=3.0) is None  # only the drop is left
        assert dict(consumer.drops_by_reason) == {"stale": 1}
    assert set(seen) == set(expected)
    for task, tensors in expected.items():
        assert set(seen[task]) == set(tensors)
        for key, original in tensors.items():
            got = seen[task][key]
            assert got.dtype == original.dtype and got.shape == original.shape, (task, key)
            assert got.contiguous().view(torch.uint8).numpy().tobytes() == original.contiguous().view(torch.uint8).numpy().tobytes()


def recorded_batch(task_id: str, rows: list[dict[str, torch.Tensor]]) -> EmittedGroup:
    """The ``EmittedGroup`` of a group of ``rows`` (a row a sample), its tensors packed as the grouping
    tier writes them."""
    return EmittedGroup(
        task_id=task_id, group_size=len(rows), sample_idx=list(range(len(rows))), trainer_version=5,
        head_version=2, tail_version=5, staleness=3, packed=pack_tensor_dict(concat_padded_tensors(rows)),
    )


async def test_demo_lag_probe_counts_what_a_tier_group_has_not_committed(config: RollstreamConfig) -> None:
    """The demo's lag per tier is its group's end minus committed offsets on its input topic,
    as ``rollstream status`` counts it; a tier that committed nothing shows no lag (None)."""
    from rollstream.demo.progress import LagProbe

    await publish_scored(config)
    names = TopicNames.of(config)
    tps = [TopicPartition(names.scored, p) for p in await topic_partitions(config.kafka, names.scored) or []]
    committer = make_consumer(config.kafka, "test-committer", group_id=names.group_id("dump"))
    await committer.start()
    try:
        committer.assign(tps)
        ends = await committer.end_offsets(tps)
        busiest = max(tps, key=lambda tp: ends[tp])
        assert ends[busiest] >= 2
        await committer.commit({tp: ends[tp] - (2 if tp == busiest else 0) for tp in tps})
    finally:
        await committer.stop()
    async with LagProbe(config) as probe:
        lags = await probe.lags()
    assert lags["dump"] == 2, lags
    assert lags["grouping"] is None, lags

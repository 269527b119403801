"""The dump tier writes the reference layout exactly, one group in one place, edge cases right.

Real broker, real Redis (the trainer's versions and weight paths), the real dump tier. The
episodes are made by the rollout worker's own ``to_episode`` (so their head/tail versions are
the message's), scored as the reward worker does, and published to ``scored``. Every path and
every field is checked against values worked out by hand from the inputs, and each group is
read back by its task id.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.configs import make_config
from harness.fakes import make_tokenizer
from harness.trajectories import multi_turn, single_turn
from harness.waits import eventually
from rollstream.api.engine import WeightUpdate
from rollstream.config import ConfigError, RollstreamConfig
from rollstream.consumers.dump import service as dump_service
from rollstream.dump.lines import DUMP_FIELDS, EXTENDED_FIELDS, read_task
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.rollout_workers.episodes import to_episode
from rollstream.state.client import RedisKeys, connect
from rollstream.state.version_store import VersionStore
from rollstream.tools.replay import ReplayOptions, replay
from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.wire import Episode, PromptTask, SampleRejected, ScoredEpisode, encode


pytestmark = pytest.mark.broker

WAIT_S = 60.0
TRAINER_VERSION = 6  # the trainer's version in Redis while the dump tier runs
WEIGHTS = {4: "/ckpt/v4", 5: "/ckpt/v5", 6: "/ckpt/v6"}
ENGINE_VERSION = 4  # the engine's version when the version-less episode ended


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer().save_pretrained(path)
    return str(path)


def without(td: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in td.items() if k != key}


@dataclass
class Group:
    """One prompt group: what is published, and the lines and file it must end as."""

    task_id: str
    group_size: int
    is_eval: bool = False
    messages: list[ScoredEpisode | SampleRejected] = field(default_factory=list)
    lines: list[dict[str, Any]] = field(default_factory=list)  # expected, sorted by (sample_idx, row)
    file: str = ""  # expected path under {fileroot}/{experiment}/{trial}

    def sample(
        self, sample_idx: int, td: dict[str, torch.Tensor], reward: float, stop: str = "stop",
        fallback_version: int = -1,
    ) -> Episode:
        task = PromptTask(task_id=self.task_id, group_size=self.group_size, data={}, is_eval=self.is_eval)
        episode = to_episode(task, sample_idx, td, stop, "worker-0", fallback_version)
        assert isinstance(episode, Episode)
        self.messages.append(ScoredEpisode(episode=episode, reward=reward))
        return episode

    def reject(self, sample_idx: int) -> None:
        self.messages.append(SampleRejected(task_id=self.task_id, sample_idx=sample_idx, group_size=self.group_size))

    def expect(
        self, sample_idx: int, seqlen: int, prompt_len: int, head: int, tail: int, reward: float,
        prompt: str, completion: str, stop: str = "stop", row: int | None = None,
    ) -> None:
        line: dict[str, Any] = {
            "task_id": self.task_id, "sample_idx": sample_idx, "seqlen": seqlen, "prompt_len": prompt_len,
            "head_version": head, "tail_version": tail, "reward": reward, "prompt": prompt, "completion": completion,
        }
        if row is not None:
            line["row"] = row
        line["_extended"] = {"row": row or 0, "stop_reason": stop, "group_size": self.group_size,
                             "trainer_version": TRAINER_VERSION, "weight_path": WEIGHTS.get(tail)}
        self.lines.append(line)


def groups() -> list[Group]:
    """Every case of the issue; ``file`` and ``lines`` are worked out by hand from the inputs."""
    single = Group("gsm:0:0", 3, file="rollout/4/gsm:0:0.jsonl")
    single.sample(0, single_turn("what is two plus two", "four <eos>", [4, 4]), 1.0)
    single.reject(1)  # no line
    single.sample(2, single_turn("what is two plus two", "five", [4]), 0.0, stop="length")
    single.expect(0, 7, 5, 4, 4, 1.0, "what is two plus two", "four <eos>")
    single.expect(2, 6, 5, 4, 4, 0.0, "what is two plus two", "five", stop="length")

    multi = Group("gsm:0:1", 2, file="rollout/5/gsm:0:1.jsonl")  # prompt | v3 v3 | user | v4 v5
    multi.sample(0, multi_turn(), 0.25)
    multi.sample(1, single_turn("<|user|> what is two", "<|assistant|> four", [4, 4]), 1.0)
    multi.expect(0, 11, 4, 3, 5, 0.25, "<|user|> what is two",
                 "<|assistant|> five <|user|> try again <|assistant|> four")
    multi.expect(1, 6, 4, 4, 4, 1.0, "<|user|> what is two", "<|assistant|> four")

    no_versions = Group("gsm:0:2", 1, file="rollout/4/gsm:0:2.jsonl")  # the engine's version
    no_versions.sample(0, without(single_turn("hello", "world <eos>", [0, 0]), "versions"), 0.5,
                       fallback_version=ENGINE_VERSION)
    no_versions.expect(0, 3, 1, 4, 4, 0.5, "hello", "world <eos>")

    no_loss_mask = Group("gsm:0:3", 1, file="rollout/5/gsm:0:3.jsonl")  # generated = versioned
    no_loss_mask.sample(0, without(single_turn("what is two", "four", [5]), "loss_mask"), 1.0)
    no_loss_mask.expect(0, 4, 3, 5, 5, 1.0, "what is two", "four")

    two_rows = Group("gsm:0:4", 2, file="rollout/4/gsm:0:4.jsonl")
    two_rows.sample(0, concat_padded_tensors([
        single_turn("hello", "world", [4], 1.0), single_turn("hello", "four five", [4, 4], 0.0)]), 0.5)
    two_rows.sample(1, concat_padded_tensors([
        single_turn("two", "three", [4], 0.5), single_turn("two plus two", "four", [4], 0.5)]), 0.5)
    two_rows.expect(0, 2, 1, 4, 4, 1.0, "hello", "world", row=0)  # padding excluded
    two_rows.expect(0, 3, 1, 4, 4, 0.0, "hello", "four five", row=1)
    two_rows.expect(1, 2, 1, 4, 4, 0.5, "two", "three", row=0)
    two_rows.expect(1, 4, 3, 4, 4, 0.5, "two plus two", "four", row=1)

    update = Group("gsm:0:5", 3, file="rollout/5/gsm:0:5.jsonl")  # spans the update 4 -> 5
    update.sample(0, single_turn("what is two plus three", "five <eos>", [4, 4]), 1.0)
    update.sample(1, single_turn("what is two plus three", "four <eos>", [4, 5]), 0.0)
    update.sample(2, single_turn("what is two plus three", "five", [5]), 1.0, stop="length")
    update.expect(0, 7, 5, 4, 4, 1.0, "what is two plus three", "five <eos>")
    update.expect(1, 7, 5, 4, 5, 0.0, "what is two plus three", "four <eos>")
    update.expect(2, 6, 5, 5, 5, 1.0, "what is two plus three", "five", stop="length")

    evaluation = Group("eval:0:0", 1, is_eval=True, file="eval-rollout/5/eval:0:0.jsonl")
    evaluation.sample(0, single_turn("what is two plus two", "four <eos>", [5, 5]), 1.0)
    evaluation.expect(0, 7, 5, 5, 5, 1.0, "what is two plus two", "four <eos>")

    unsafe = Group("../../escape/me", 1, file="rollout/4/%2E.%2F..%2Fescape%2Fme.jsonl")
    unsafe.sample(0, single_turn("hello", "world", [4]), 1.0)
    unsafe.expect(0, 2, 1, 4, 4, 1.0, "hello", "world")
    return [single, multi, no_versions, no_loss_mask, two_rows, update, evaluation, unsafe]


def expected_lines(group: Group, fields: str) -> list[dict[str, Any]]:
    out = []
    for line in group.lines:
        record = {k: v for k, v in line.items() if k != "_extended"}
        if fields == "extended":
            record.pop("row", None)
            record.update(line["_extended"])
        out.append(record)
    return out


async def publish(config: RollstreamConfig, messages: list[ScoredEpisode | SampleRejected]) -> None:
    names = TopicNames.of(config)
    producer = make_producer(config.kafka, "test")
    await producer.start()
    try:
        for message in messages:
            task_id = message.episode.task_id if isinstance(message, ScoredEpisode) else message.task_id
            await producer.send_and_wait(names.scored, encode(message), key=task_id.encode())
    finally:
        await producer.stop()


def files_under(base: Path) -> dict[str, bytes]:
    return {str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fields", ["reference", "extended"])
async def test_dump_tier_layout_fields_and_read_back(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tokenizer_dir: str, tmp_path: Path, fields: str,
) -> None:
    config = make_config(kafka_bootstrap, redis_url, unique_name, {
        "rollout": {"tokenizer_path": tokenizer_dir, "fileroot": str(tmp_path / "dumps")},
        "dump": {"fields": fields},
    })
    exp = config.experiment
    client = connect(config.redis)
    for version, path in WEIGHTS.items():  # the trainer published 4, 5, then 6
        await VersionStore(client, RedisKeys(exp.experiment_name, exp.trial_name)).publish(WeightUpdate(version, path))
    await client.aclose()
    await ensure_topics(config.kafka, TopicNames.of(config))
    all_groups = groups()
    update = next(g for g in all_groups if g.task_id == "gsm:0:5")
    first = [m for g in all_groups for m in (g.messages[:1] if g is update else g.messages)]
    await publish(config, first)  # the update group's first sample only: tail 4

    base = tmp_path / "dumps" / exp.experiment_name / exp.trial_name
    stop = asyncio.Event()
    service = asyncio.create_task(dump_service.run(config, stop))

    def count_lines() -> int:  # distinct lines: a group that moves has two files for a moment
        if service.done():
            service.result()
        return sum(len(read_task(tmp_path / "dumps", exp.experiment_name, exp.trial_name, g.task_id, g.is_eval))
                   for g in all_groups)

    async def lines_are(n: int) -> bool:
        return count_lines() == n

    total = sum(len(g.lines) for g in all_groups)
    try:
        await eventually(lambda: lines_are(total - 2), f"{total - 2} dump lines")
        assert (base / "rollout/4/gsm:0:5.jsonl").is_file()  # before the update: version 4
        await publish(config, update.messages[1:])
        await eventually(lambda: lines_are(total), f"{total} dump lines")
    finally:
        stop.set()
        await asyncio.wait_for(service, WAIT_S)

    # every path: one file per group, in its version's directory, and nothing else anywhere
    assert sorted(files_under(tmp_path / "dumps")) == sorted(
        f"{exp.experiment_name}/{exp.trial_name}/{g.file}" for g in all_groups)
    for group in all_groups:
        lines = read_task(tmp_path / "dumps", exp.experiment_name, exp.trial_name, group.task_id, group.is_eval)
        assert lines == expected_lines(group, fields), group.task_id  # every field
        order = [*DUMP_FIELDS, *EXTENDED_FIELDS] if fields == "extended" else list(DUMP_FIELDS)
        for line in lines:  # the reference's nine first and in order, extras after
            assert list(line)[: len(order)] == order
            assert list(line) == order + (["row"] if fields == "reference" and "row" in line else [])
        keys = [(line["sample_idx"], line.get("row", 0)) for line in lines]
        assert len(set(keys)) == len(keys)  # (task_id, sample_idx[, row]) is a key

    # the same records dumped again (here by a replay into the same fileroot) change nothing
    before = files_under(tmp_path / "dumps")
    stats = await replay(config, "scored", ReplayOptions(to_dump=tmp_path / "dumps"))
    assert stats.completed
    assert files_under(tmp_path / "dumps") == before


async def test_dump_tier_refuses_when_the_rollout_workers_write_the_dumps(
    kafka_bootstrap: str, redis_url: str, unique_name: str,
) -> None:
    config = make_config(kafka_bootstrap, redis_url, unique_name, {"rollout": {"dump_to_file": True}})
    with pytest.raises(ConfigError, match="rollout.dump_to_file"):
        await dump_service.run(config, asyncio.Event())


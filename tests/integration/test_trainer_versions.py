"""Version publishing that cannot go wrong, against a real Redis: versions only go up, a crash
between writing a checkpoint and publishing it leaves Redis on a complete checkpoint, retention
deletes checkpoints and their Redis entries together; and the example trainer resumes right
after such a crash, and after a crash between a commit and its steps-file line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import yaml

from harness.configs import make_config
from harness.episodes import scored
from rollstream.api.engine import WeightUpdate
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.consumers.grouping.groups import CompleteGroup
from rollstream.dev.redis_server import LocalRedisServer
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.state.client import RedisKeys
from rollstream.state.version_store import VersionStore
from rollstream.tiny.text_model import build_tiny_model, default_corpus
from rollstream.trainer import Checkpoint, CheckpointError, Checkpoints, StepLedger, VersionPublisher, VersionRefused
from rollstream.wire import encode


pytestmark = pytest.mark.broker

REPO = Path(__file__).resolve().parents[2]


def write_checkpoint(checkpoints: Checkpoints, version: int) -> Checkpoint:
    with checkpoints.write(version) as out:
        (out / "weights.bin").write_bytes(bytes([version]) * 64)
    found = checkpoints.get(version)
    assert found is not None
    return found


async def test_versions_only_go_up_and_only_complete_checkpoints_are_published(
    redis_url: str, unique_name: str, tmp_path: Path, redis_client: aioredis.Redis
) -> None:
    config = make_config("127.0.0.1:1", redis_url, unique_name)
    checkpoints = Checkpoints(tmp_path / "ckpt")
    async with VersionPublisher(config, checkpoints, keep=2) as publisher:
        assert await publisher.current_version() == 0 and await publisher.current() is None
        await publisher.publish(3, write_checkpoint(checkpoints, 3))
        elsewhere = Checkpoints(tmp_path / "other-trainer")
        for lower in (3, 2):
            with pytest.raises(VersionRefused, match="current version is 3 and versions only go up"):
                await publisher.publish(lower, write_checkpoint(elsewhere, lower))
        with pytest.raises(CheckpointError, match="is version 3, not 4"):
            await publisher.publish(4, elsewhere.get(3))  # type: ignore[arg-type]
        with pytest.raises(CheckpointError, match="do not exist"):
            await publisher.publish(4, str(tmp_path / "never-written"))
        with pytest.raises(ValueError):
            await publisher.publish(-1, "s3://bucket/weights")
        update = await publisher.current()
        assert update is not None and (update.version, update.path) == (3, str(checkpoints.path_for(3).resolve()))
        await publisher.publish(20, "s3://bucket/v20")  # a remote location is taken as given
        assert await publisher.current_version() == 20


async def test_retention_deletes_old_checkpoints_and_their_redis_entries_together(
    redis_url: str, unique_name: str, tmp_path: Path, redis_client: aioredis.Redis
) -> None:
    config = make_config("127.0.0.1:1", redis_url, unique_name)
    checkpoints = Checkpoints(tmp_path / "ckpt")
    keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
    async with VersionPublisher(config, checkpoints, keep=2) as publisher:
        for version in range(1, 6):
            await publisher.publish(version, write_checkpoint(checkpoints, version))
    assert [c.version for c in checkpoints.complete()] == [4, 5]
    entries = await redis_client.hgetall(keys.key("weights"))
    assert sorted(int(k) for k in entries) == [4, 5]
    store = VersionStore(redis_client, keys)
    assert await store.get_version() == 5 and (await store.get_update(3)) is None


CRASH = textwrap.dedent("""
    import os, signal, sys
    from rollstream.config import load_config
    from rollstream.trainer import Checkpoints, SyncVersionPublisher
    config = load_config(sys.argv[1])
    checkpoints = Checkpoints(config.trainer.checkpoint_dir)
    checkpoints.remove_partials()
    with SyncVersionPublisher(config, checkpoints) as versions:
        version = versions.current_version() + 1
        if checkpoints.get(version) is None:  # complete and never published: publish it as it is
            with checkpoints.write(version) as out:
                (out / "weights.bin").write_bytes(bytes([version % 256]) * 4096)
                if sys.argv[2] == "mid-write":
                    os.kill(os.getpid(), signal.SIGKILL)
        if sys.argv[2] == "before-publish":
            os.kill(os.getpid(), signal.SIGKILL)
        versions.publish(version, checkpoints.get(version))
""")


def crash_run(config_file: Path, when: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", CRASH, str(config_file), when], env=env, capture_output=True).returncode


@pytest.mark.parametrize("when", ["mid-write", "before-publish"])
async def test_a_crash_before_the_publish_leaves_redis_on_a_complete_checkpoint(
    redis_url: str, unique_name: str, tmp_path: Path, redis_client: aioredis.Redis, when: str
) -> None:
    config = make_config("127.0.0.1:1", redis_url, unique_name, {"trainer": {"checkpoint_dir": str(tmp_path / "ckpt")}})
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump({"redis": {"url": redis_url}, "experiment": {"experiment_name": unique_name, "trial_name": "t0"},
                                           "trainer": {"checkpoint_dir": str(tmp_path / "ckpt")}}))
    assert crash_run(config_file, "none") == 0  # version 1, complete and published
    assert crash_run(config_file, when) == -signal.SIGKILL
    keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
    update = await VersionStore(redis_client, keys).get_update()
    assert update is not None and update.version == 1
    published = Checkpoint.read(Path(update.path))
    assert published is not None and published.version == 1  # complete: its marker is there
    assert (Path(update.path) / "weights.bin").read_bytes() == bytes([1]) * 4096
    checkpoints = Checkpoints(tmp_path / "ckpt")
    assert [c.version for c in checkpoints.complete()] == ([1] if when == "mid-write" else [1, 2])
    assert crash_run(config_file, "none") == 0  # the next run goes on from what is published
    assert (await VersionStore(redis_client, keys).get_update()).version == 2  # type: ignore[union-attr]


class AnswerLostOnce(VersionStore):
    """A real store whose first publish is done in Redis but answered with a lost connection."""

    calls = 0

    async def publish_newer(self, update: WeightUpdate) -> int | None:
        self.calls += 1
        current = await super().publish_newer(update)
        if self.calls == 1:
            raise ConnectionError("the answer was lost")
        return current


async def test_a_publish_waits_out_a_redis_restart_and_one_whose_answer_was_lost_counts(
    unique_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer's publish while Redis is down waits for it (the one retry policy, logged)
    instead of raising out of the training loop (a chaos run found trainers exiting on every
    Redis restart); a retried publish that finds its own version current is done."""
    with LocalRedisServer(tmp_path / "redis", appendonly=True) as redis:
        config = make_config("127.0.0.1:1", redis.url, unique_name)
        checkpoints = Checkpoints(tmp_path / "ckpt")
        async with VersionPublisher(config, checkpoints, keep=2) as publisher:
            await publisher.publish(1, write_checkpoint(checkpoints, 1))
            redis.stop()
            second = asyncio.create_task(publisher.publish(2, write_checkpoint(checkpoints, 2)))
            await asyncio.sleep(1.5)
            assert not second.done()  # waiting, not failed
            redis.start()
            await asyncio.wait_for(second, 30)
            assert await publisher.current_version() == 2
            assert any("publishing weight version 2" in r.getMessage() for r in caplog.records)
            client = aioredis.from_url(redis.url)
            try:
                publisher.store = lossy = AnswerLostOnce(client, RedisKeys(unique_name, "t0"))
                await publisher.publish(3, write_checkpoint(checkpoints, 3))
                assert lossy.calls == 2 and await publisher.current_version() == 3
                with pytest.raises(VersionRefused):  # not a retry: versions only go up
                    await publisher.publish(3, checkpoints.get(3))  # type: ignore[arg-type]
            finally:
                await client.aclose()


# -- the example trainer across a crash between its checkpoint and its commit --

def group(task: str) -> CompleteGroup:
    eps = tuple(scored(task, i, 2, reward=float(i), gen_len=2 + i, version=0) for i in range(2))
    return CompleteGroup(task, 2, False, eps, 0, 0, 0, 0, 0.0)


def run_example(config_file: Path, steps: int, steps_file: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(REPO / "examples/grpo_trainer.py"), "--config", str(config_file),
            "--set", f"trainer.max_steps={steps}", "--steps-file", str(steps_file)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
async def test_the_example_trainer_resumes_after_a_crash_between_checkpoint_and_commit(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path, redis_client: aioredis.Redis
) -> None:
    model = build_tiny_model(tmp_path / "model", default_corpus(), vocab_size=300, hidden_size=16, num_layers=1, num_heads=2)
    ckpt = tmp_path / "ckpt"
    tree = {"kafka": {"bootstrap_servers": kafka_bootstrap, "partitions": 1}, "redis": {"url": redis_url},
            "experiment": {"experiment_name": unique_name, "trial_name": "t0"},
            "staleness": {"groups_per_step": 2, "max_head_offpolicyness": 3},  # 3 steps of version-0 groups: none stale
            "trainer": {"group_id": f"{unique_name}-trainer", "checkpoint_dir": str(ckpt),
                        "model_path": str(model), "learning_rate": 1e-3, "keep_checkpoints": 2, "poll_timeout_ms": 200}}
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(tree))
    config = make_config(kafka_bootstrap, redis_url, unique_name, {"kafka": {"partitions": 1}})
    names = TopicNames(unique_name, "t0")
    await ensure_topics(config.kafka, names)
    producer = make_producer(config.kafka, "test-batches")
    await producer.start()
    for task in "abcdef":
        await producer.send_and_wait(names.batches, encode(build_emitted_group(group(task), trainer_version=0)))
    await producer.stop()

    steps_file = tmp_path / "steps.jsonl"
    first = run_example(config_file, 1, steps_file)
    assert first.returncode == 0, first.stderr[-3000:]
    # what a crash after committing step 1 and in the middle of writing its steps-file line leaves
    line = steps_file.read_text()
    steps_file.write_text(line[:20])
    # what a crash after writing step 2's checkpoint and before committing it leaves behind
    stray = Checkpoints(ckpt)
    with stray.write(2) as out:
        (out / "half-trained").write_text("never committed")
    second = run_example(config_file, 3, steps_file)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "discarding checkpoint v2 (step 2 was never committed)" in second.stderr
    assert "step 1: its line was missing" in second.stderr
    lines = steps_file.read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]  # every committed step, once
    assert lines[0] + "\n" == line  # written from the record saved with the checkpoint, as it was

    entries = StepLedger(ckpt / "ledger.jsonl").read()
    assert [(e.step, e.task_ids) for e in entries] == [(1, ["a", "b"]), (2, ["c", "d"]), (3, ["e", "f"])]
    keys = RedisKeys(unique_name, "t0")
    update = await VersionStore(redis_client, keys).get_update()
    assert update is not None and update.version == 3 and Path(update.path) == (ckpt / "v3").resolve()
    assert [c.version for c in Checkpoints(ckpt).complete()] == [2, 3]  # keep_checkpoints: 2
    assert not (ckpt / "v2" / "half-trained").exists() and (ckpt / "v2" / "config.json").is_file()
    assert sorted(int(k) for k in await redis_client.hgetall(keys.key("weights"))) == [2, 3]
    assert json.loads((ckpt / "v3" / "rollstream-checkpoint.json").read_text())["step"] == 3

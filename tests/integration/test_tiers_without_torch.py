"""The tiers that run no model never import torch and stay small: the producer, reward,
grouping and dump tiers, each a real ``rollstream <tier>`` process on the real broker and
Redis, do their work (prompts with an image published; episodes decoded with the model's
tokenizer and scored in the reward process pool; a group padded into a batch; a scored episode
dumped as text) under a tripwire that kills the process the moment anything imports torch
(``harness/torch_tripwire.py``), and their peak resident memory stays under
:data:`MAX_RSS` (``import torch`` alone is ~550 MB)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path
from typing import Any

import numpy
import pytest
from tokenizers import Tokenizer as TokenizerFile

from harness.configs import write_config
from harness.images import noise_png
from harness.producer_feed import read_prompts
from harness.scored_feed import group_messages, read_all, write_scored
from harness.services import free_port
from harness.tiers import TierProcess
from harness.torch_tripwire import TRIPPED
from rollstream.config import config_from_dict
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.wire import EmittedGroup, Episode, ScoredEpisode, decode_group, decode_scored, encode, encode_arrays


pytestmark = [pytest.mark.broker, pytest.mark.timeout(240)]

MAX_RSS = 150 * 1024 * 1024
WAIT_S = 90.0


class Tier:
    """``rollstream <tier>`` under the torch tripwire, with its health port; logs to a file."""

    def __init__(self, tier: str, tree: dict[str, Any], tmp_path: Path) -> None:
        self.port = free_port()
        self.tree = {**tree, "metrics": {"port": self.port}}
        self.config = config_from_dict(self.tree)
        path = write_config(tmp_path / f"{tier}.yaml", self.tree)
        self.process = TierProcess(tier, path, tmp_path / f"{tier}.log", module="harness.torch_tripwire")
        self.process.start()

    def check_alive(self) -> None:
        code = self.process.exit_code()
        assert code is None, (
            f"the tier exited with {code}{' (torch was imported)' if code == TRIPPED else ''}:\n"
            f"{self.process.tail(60)}"
        )

    def wait_ready(self) -> None:
        self.process.wait_probe(self.port, "/readyz", timeout=WAIT_S)

    def peak_rss(self) -> int:
        self.check_alive()
        self.process.sample()
        return self.process.peak_rss

    def stop(self) -> None:
        if self.process.running():
            assert self.process.stop() == 0, self.process.tail(60)


def base_tree(kafka_bootstrap: str, redis_url: str, name: str) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": kafka_bootstrap, "partitions": 2, "transaction_timeout_ms": 15000},
        "redis": {"url": redis_url},
        "experiment": {"experiment_name": name, "trial_name": "t0"},
        "staleness": {"enabled": False},
    }


def check_small(tier: Tier) -> None:
    peak = tier.peak_rss()
    assert peak < MAX_RSS, f"peak RSS {peak / 2**20:.0f} MiB, over {MAX_RSS / 2**20:.0f} MiB"


async def test_producer_publishes_image_prompts_without_torch(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path,
) -> None:
    png = noise_png(1)
    rows = [{"messages": "look", "images": base64.b64encode(png).decode()},
            *({"messages": f"q{i}", "answer": str(i)} for i in range(1, 6))]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tree = base_tree(kafka_bootstrap, redis_url, unique_name)
    # a budget of 2 prompts and no trainer: the producer publishes 2, then waits (stays up)
    tree["staleness"] = {"enabled": True, "groups_per_step": 2, "max_head_offpolicyness": 0}
    tree["producer"] = {"dataset": str(dataset), "group_size": 2, "admission_poll_seconds": 0.2}
    tier = Tier("producer", tree, tmp_path)
    try:
        tier.wait_ready()
        deadline = time.monotonic() + WAIT_S
        prompts: list = []
        while len(prompts) < 2:
            tier.check_alive()
            assert time.monotonic() < deadline, f"{len(prompts)} prompts after {WAIT_S}s:\n{tier.process.tail(60)}"
            await asyncio.sleep(0.5)
            prompts = await read_prompts(tier.config)
        first = {task.index: task for _, task in prompts}[0]
        assert first.data["images"] == [png]
        check_small(tier)
    finally:
        tier.stop()


def text_episode(tokenizer: TokenizerFile, index: int, prompt: str, completion: str, answer: str) -> Episode:
    """A one-row episode of ``prompt`` + ``completion`` in the tokenizer's ids (numpy arrays)."""
    prompt_ids, completion_ids = tokenizer.encode(prompt).ids, tokenizer.encode(completion).ids
    tokens = numpy.array([prompt_ids + completion_ids], dtype=numpy.int32)
    generated = numpy.array([[0] * len(prompt_ids) + [1] * len(completion_ids)], dtype=numpy.int32)
    trajectory = {"input_ids": tokens, "attention_mask": numpy.ones(tokens.shape, dtype=bool), "loss_mask": generated,
                  "logprobs": -0.5 * generated.astype(numpy.float32), "versions": generated - 1}
    return Episode(task_id=f"r:0:{index}", sample_idx=0, group_size=1, trajectory=encode_arrays(trajectory),
                   data={"answer": answer})


async def test_reward_worker_scores_without_torch(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path, tiny_model_dir: Path,
) -> None:
    """The reward tier decodes with the model's tokenizer.json (no transformers) and scores in
    its process pool: the completion holding the answer gets 1.0, the other 0.0."""
    tree = base_tree(kafka_bootstrap, redis_url, unique_name)
    tree["reward"] = {"tokenizer_path": str(tiny_model_dir), "worker_id": "r0", "max_workers": 1,
                      "session_timeout_ms": 6000, "reward_fn": "rollstream.rewards:exact_match_reward"}
    names = TopicNames(unique_name, "t0")
    await ensure_topics(config_from_dict(tree).kafka, names)
    tokenizer = TokenizerFile.from_file(str(tiny_model_dir / "tokenizer.json"))
    episodes = [text_episode(tokenizer, 0, "3+4=", "the answer is 7", "7"),
                text_episode(tokenizer, 1, "3+5=", "the answer is 9", "8")]
    tier = Tier("reward-worker", tree, tmp_path)
    try:
        tier.wait_ready()
        producer = make_producer(tier.config.kafka, "test-episodes")
        await producer.start()
        try:
            for episode in episodes:
                await producer.send_and_wait(names.episodes, encode(episode), key=episode.task_id.encode())
        finally:
            await producer.stop()
        scored = [decode_scored(r.value) for r in await read_all(tier.config, names.scored, until=2)]
        assert all(isinstance(s, ScoredEpisode) for s in scored), scored
        assert {s.episode.task_id: s.reward for s in scored} == {"r:0:0": 1.0, "r:0:1": 0.0}
        check_small(tier)
    finally:
        tier.stop()


async def test_grouping_emits_a_batch_without_torch(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path,
) -> None:
    tree = base_tree(kafka_bootstrap, redis_url, unique_name)
    tree["grouping"] = {"instance_id": "g0", "commit_interval_ms": 100, "session_timeout_ms": 6000}
    tier = Tier("grouping", tree, tmp_path)
    try:
        tier.wait_ready()
        await write_scored(tier.config, [(m, 0) for m in group_messages("t0", size=4, version=1)])
        records = await read_all(tier.config, TopicNames(unique_name, "t0").batches, until=1)
        batch = decode_group(records[0].value)
        assert isinstance(batch, EmittedGroup) and batch.task_id == "t0" and batch.packed.keys
        check_small(tier)
    finally:
        tier.stop()


async def test_dump_writes_text_without_torch(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path, tiny_model_dir: Path,
) -> None:
    tree = base_tree(kafka_bootstrap, redis_url, unique_name)
    tree["rollout"] = {"tokenizer_path": str(tiny_model_dir), "fileroot": str(tmp_path / "dumps")}
    await ensure_topics(config_from_dict(tree).kafka, TopicNames(unique_name, "t0"))
    tier = Tier("dump", tree, tmp_path)
    try:
        tier.wait_ready()
        await write_scored(tier.config, [(m, 0) for m in group_messages("d0", size=2, version=1)])
        deadline = time.monotonic() + WAIT_S
        lines: list[dict] = []
        while len(lines) < 2:
            tier.check_alive()
            assert time.monotonic() < deadline, f"{len(lines)} dump lines after {WAIT_S}s:\n{tier.process.tail(60)}"
            await asyncio.sleep(0.5)
            lines = [json.loads(line) for f in (tmp_path / "dumps").rglob("*.jsonl") for line in f.read_text().splitlines()]
        assert sorted(line["sample_idx"] for line in lines) == [0, 1]
        assert all(isinstance(line["completion"], str) and line["completion"] for line in lines)
        check_small(tier)
    finally:
        tier.stop()

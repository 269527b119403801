"""The whole pipeline as separate processes on the real broker and Redis.

producer -> rollout worker (HFEngine, tiny model built offline) -> reward worker -> grouping
consumer -> BatchStream (this test plays the trainer: it acks each step and publishes a new
weight version, so the rollout worker reloads weights mid-run). One rollout worker is stopped
with SIGTERM mid-run and replaced. Asserts: every admitted prompt is accounted for exactly
once (emitted group or counted drop), shapes/dtypes/masks, logprobs of generated tokens match
a fresh forward pass of the weights of the version that generated them within 1e-4, versions
are -1 on prompt tokens and advance mid-run (some sequences carry two versions), the
staleness budget is never exceeded, and every tier exits 0 on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollstream.trainer import BatchStream, TrainingBatch, VersionPublisher
from rollstream.config import RollstreamConfig
from rollstream.kafka.clients import make_consumer
from rollstream.kafka.topics import TopicNames
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys, connect
from rollstream.tiny.text_model import build_tiny_model, default_corpus
from rollstream.wire import Batch, GroupDropped, decode_batch, decode_prompt
from tests.e2e.trees import pipeline_tree, write_tree

pytestmark = [pytest.mark.broker, pytest.mark.slow]

PROMPTS = 20
GROUP_SIZE = 4
STEP_GROUPS = 4
VERSIONS = PROMPTS // STEP_GROUPS + 1
ETA = 1


def _save_versions(base: Path, out: Path) -> list[Path]:
    """Version 0 is the built model; version v > 0 is a perturbed copy (distinct weights)."""
    paths = [base]
    model = AutoModelForCausalLM.from_pretrained(base)
    for version in range(1, VERSIONS + 1):
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.02)
        path = out / f"v{version}"
        model.save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (base / name).exists():
                (path / name).write_bytes((base / name).read_bytes())
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("e2e-model")
    base = build_tiny_model(root / "v0", default_corpus(), vocab_size=300, hidden_size=32, num_layers=2, num_heads=4)
    return _save_versions(base, root)


def _write_inputs(tmp: Path, name: str, kafka: str, redis_url: str, model: Path) -> tuple[Path, RollstreamConfig]:
    dataset = tmp / "prompts.jsonl"
    rows = [{"prompt": f"What is {i % 5}+{i % 4}? Answer:", "answer": str(i % 5 + i % 4)} for i in range(PROMPTS)]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tree = pipeline_tree(
        name, kafka, redis_url, model, trial="e2e", step_groups=STEP_GROUPS, eta=ETA,
        producer={"dataset": str(dataset), "group_size": GROUP_SIZE, "batch_linger_ms": 20},
        # two samples at a time: a step's samples take several waves, so a published version
        # lands while some sample is mid-generation (rows spanning two versions, checked
        # below) rather than only between waves. (No min_new_tokens: it masks EOS, and the
        # logprobs recorded are then not those of the plain forward pass checked below.)
        rollout={"max_concurrent_rollouts": 2, "gconfig": {"max_new_tokens": 32, "temperature": 1.0}},
    )
    return write_tree(tmp / "rollstream.yaml", tree)


class Tier:
    """One tier as a child process, logging to a file in the test's directory."""

    def __init__(self, name: str, config: Path, logdir: Path) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
        env.pop("REDIS_URL", None)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollstream.cli", name.split("#")[0], "--config", str(config)],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} did not stop on SIGTERM; log tail:\n{self.tail()}") from None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


async def _read_all(config: RollstreamConfig, topic: str, decode: Any) -> list[Any]:
    consumer = make_consumer(config.kafka, "e2e-reader", topic, group_id=None)
    await consumer.start()
    try:
        messages: list[Any] = []
        while True:
            fetched = await consumer.getmany(timeout_ms=1500)
            if not fetched:
                return messages
            messages.extend(decode(r.value) for records in fetched.values() for r in records)
    finally:
        await consumer.stop()


async def _watch_budget(budget: StalenessBudget, violations: list[dict[str, int]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        usage = await budget.usage()
        if usage["admitted"] - usage["dropped"] > usage["capacity"]:
            violations.append(usage)
        await asyncio.sleep(0.1)


def _check_batch_tensors(batch: TrainingBatch) -> None:
    t = batch.tensors
    n, length = t["input_ids"].shape
    assert n == sum(batch.group_sizes) and len(batch.task_ids) == STEP_GROUPS
    expected = {"input_ids": torch.int32, "attention_mask": torch.bool, "loss_mask": torch.int32,
                "logprobs": torch.float32, "versions": torch.int32}
    for key, dtype in expected.items():
        assert t[key].dtype == dtype and t[key].shape == (n, length), key
    assert t["rewards"].dtype == torch.float32 and t["rewards"].shape == (n,)
    generated = t["loss_mask"].bool()
    assert not (generated & ~t["attention_mask"]).any()
    assert (t["versions"][~generated] == -1).all(), "prompt and pad positions carry version -1"
    assert (t["versions"][generated] >= 0).all()
    assert (t["logprobs"][~generated] == 0).all()
    assert generated.any(dim=1).all(), "every row generated something"


def _check_logprobs(batches: list[TrainingBatch], weights: list[Path]) -> int:
    """Recompute every generated token's logprob with the weights of its version."""
    models: dict[int, Any] = {}
    checked = 0
    for batch in batches:
        t = batch.tensors
        for row in range(t["input_ids"].shape[0]):
            seqlen = int(t["attention_mask"][row].sum())
            ids = t["input_ids"][row, :seqlen].long()
            versions = t["versions"][row, :seqlen]
            for version in sorted({int(v) for v in versions.tolist() if v >= 0}):
                model = models.get(version) or models.setdefault(
                    version, AutoModelForCausalLM.from_pretrained(weights[version]).eval())
                with torch.no_grad():
                    logits = model(ids.unsqueeze(0)).logits[0].float()
                expected = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None]).squeeze(1)
                positions = (versions[1:] == version).nonzero().squeeze(1)
                got = t["logprobs"][row, 1:seqlen][positions]
                torch.testing.assert_close(got, expected[positions], atol=1e-4, rtol=0)
                checked += len(positions)
    return checked


async def test_pipeline_end_to_end(
    weights: list[Path], kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    config_path, config = _write_inputs(tmp_path, unique_name, kafka_bootstrap, redis_url, weights[0])
    names = TopicNames(config.experiment.experiment_name, config.experiment.trial_name)
    redis = connect(config.redis)
    budget = StalenessBudget(redis, RedisKeys(names.experiment, names.trial), ETA, STEP_GROUPS)
    violations: list[dict[str, int]] = []
    watching = asyncio.Event()
    watcher = asyncio.create_task(_watch_budget(budget, violations, watching))
    tiers = {n: Tier(n, config_path, tmp_path) for n in ("grouping", "reward-worker", "rollout-worker", "producer")}
    batches: list[TrainingBatch] = []
    try:
        async with BatchStream(config, ledger=False) as consumer, VersionPublisher(config) as publisher:
            deadline = time.monotonic() + 300
            while len(batches) * STEP_GROUPS < PROMPTS and time.monotonic() < deadline:
                batch = await consumer.next_batch(timeout=10)
                if batch is None:
                    assert all(t.proc.poll() in (None, 0) for t in tiers.values()), _tails(tiers)
                    continue
                _check_batch_tensors(batch)
                batches.append(batch)
                assert await consumer.ack(batch)
                version = len(batches)
                await publisher.publish(version, str(weights[version]))
                if version == 1:  # SIGTERM one rollout worker mid-run; its replacement carries on
                    assert tiers["rollout-worker"].terminate() == 0, tiers["rollout-worker"].tail()
                    tiers["rollout-worker#2"] = Tier("rollout-worker#2", config_path, tmp_path)
        assert len(batches) * STEP_GROUPS == PROMPTS, f"only {len(batches)} steps\n{_tails(tiers)}"
        assert tiers["producer"].proc.wait(30) == 0, tiers["producer"].tail()
        codes = {name: tier.terminate() for name, tier in tiers.items() if name != "producer"}
        assert all(code == 0 for code in codes.values()), (codes, _tails(tiers))
    finally:
        for tier in tiers.values():
            if tier.proc.poll() is None:
                tier.proc.kill()
        watching.set()
        await watcher
        await redis.aclose()

    admitted = {m.task_id for m in await _read_all(config, names.prompts, decode_prompt)}
    outcomes = await _read_all(config, names.batches, decode_batch)
    emitted = [tid for m in outcomes if isinstance(m, Batch) for tid in m.task_ids]
    dropped = [m.task_id for m in outcomes if isinstance(m, GroupDropped)]
    print(f"\ne2e: admitted={len(admitted)} emitted={len(emitted)} dropped={len(dropped)} steps={len(batches)}")
    assert len(admitted) == PROMPTS
    assert len(emitted) + len(dropped) == len(set(emitted) | set(dropped)), "a group was emitted twice"
    assert set(emitted) | set(dropped) == admitted
    assert sorted(tid for b in batches for tid in b.task_ids) == sorted(emitted)

    assert not violations, f"staleness budget exceeded: {violations[:3]}"
    checked = _check_logprobs(batches, weights)
    all_versions = [sorted({int(v) for v in row.tolist() if v >= 0}) for b in batches for row in b.tensors["versions"]]
    print(f"e2e: logprobs checked={checked} rows spanning two versions={sum(len(v) > 1 for v in all_versions)}")
    assert max(max(v) for v in all_versions) >= 2, "rollout workers followed the published versions"
    assert any(len(v) > 1 for v in all_versions), "some sequence was generated across a weight update"
    reloaded = [t for t in tiers.values() if "rollout-worker" in t.name]
    assert any("version" in t.log.read_text() for t in reloaded)


def _tails(tiers: dict[str, Tier]) -> str:
    return "\n".join(f"--- {name}\n{tier.tail()}" for name, tier in tiers.items())

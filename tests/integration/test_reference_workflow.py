"""The reference guide's workflow template, changed only in its imports, through the whole pipeline.

producer -> rollout worker (HF engine, tiny model) -> reward worker (no reward function: the
workflow scores itself) -> grouping -> StepStream, all in this process on the real broker
and Redis. 12 prompts x 4 samples, some samples rejected (``None``) and some raising, for each
return form a reference workflow may use (``reward``, ``rewards``, int64 tensors, no
``attention_mask``). Asserts: every prompt is accounted for with the right outcome (a batch
with its rejected/failed counts, or a drop: ``all_rejected`` / ``all_failed`` with the first
error), and every row is standard: prompt then completion, masks, the engine's logprobs
(recomputed by a forward pass) and versions, the workflow's reward.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from harness.configs import make_config
from harness.ledger import read_topic
from harness.waits import stop_in_process_tiers
from rollstream.config import RollstreamConfig
from rollstream.consumers.grouping import service as grouping_service
from rollstream.kafka.topics import TopicNames
from rollstream.producers import service as producer_service
from rollstream.reward_workers import service as reward_service
from rollstream.rollout_workers import service as rollout_service
from rollstream.state.budget import StalenessBudget
from rollstream.state.client import RedisKeys, connect
from rollstream.testing import workflow_tokenizer
from rollstream.tiny.text_model import build_tiny_model, default_corpus
from rollstream.trainer import StepStream, TrainingStep
from rollstream.wire import EmittedGroup, GroupDropped, ScoredEpisode, decode_group, decode_prompt, decode_scored
from tests.workflow_pkg.reward import number_reward
from tests.workflow_pkg.variants import FORMS


pytestmark = [pytest.mark.broker, pytest.mark.timeout(240)]

GROUP = 4
# Per prompt: (samples the workflow rejects, samples that raise) and how the group must end.
PLAN: list[tuple[list[int], list[int], tuple[str, ...]]] = [
    ([], [], ("batch", "4", "0", "0")),
    ([1], [], ("batch", "3", "1", "0")),
    ([], [2], ("batch", "3", "0", "1")),
    ([0], [3], ("batch", "2", "1", "1")),
    ([0, 1, 2, 3], [], ("all_rejected", "all 4 samples rejected by the workflow")),
    ([], [0, 1, 2, 3], ("all_failed", "4 of 4 samples failed, 0 rejected; first failure (sample 0): "
                                      "RuntimeError: scripted failure of sample 0")),
    ([0, 1], [2, 3], ("all_failed", "2 of 4 samples failed, 2 rejected; first failure (sample 2)")),
    ([0, 1, 2], [], ("batch", "1", "3", "0")),
    ([], [0, 1, 2], ("batch", "1", "0", "3")),
    ([], [], ("batch", "4", "0", "0")),
    ([3], [0], ("batch", "2", "1", "1")),
    ([], [], ("batch", "4", "0", "0")),
]
EMITTED = sum(1 for *_, outcome in PLAN if outcome[0] == "batch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("reference-workflow") / "tiny", default_corpus(),
                            vocab_size=300, hidden_size=32, num_layers=2, num_heads=4)


def _rows() -> list[dict[str, Any]]:
    rows = []
    for i, (reject, fail, _) in enumerate(PLAN):
        a, b = i % 5, i % 4
        rows.append({"messages": [{"role": "user", "content": f"What is {a}+{b}?"}], "answer": str(a + b),
                     "reject": reject, "fail": fail})
    return rows


def _config(kafka: str, redis_url: str, name: str, model: Path, dataset: Path, form: str) -> RollstreamConfig:
    workflow = {"path": "tests.workflow_pkg.ScriptedTemplate", "kwargs": {
        "gconfig": "$gconfig", "tokenizer": "$tokenizer", "reward_fn": "tests.workflow_pkg.number_reward", "form": form}}
    return make_config(kafka, redis_url, name, {
        "staleness": {"max_head_offpolicyness": 15, "groups_per_step": 1},  # 16 prompts at version 0
        "producer": {"dataset": str(dataset), "group_size": GROUP, "batch_linger_ms": 20},
        "rollout": {"model_path": str(model), "seed": 0, "worker_id": "rw", "max_concurrent_rollouts": 8,
                    "commit_interval_seconds": 0.2, "workflows": {"template": workflow},
                    "default_workflow": "template", "gconfig": {"max_new_tokens": 6}},
        "reward": {"reward_fn": "", "worker_id": "rew", "session_timeout_ms": 6000},
        "grouping": {"instance_id": "g", "commit_interval_ms": 50, "session_timeout_ms": 6000},
        "trainer": {"group_id": f"{name}-trainer"},
    })


async def _train(config: RollstreamConfig, tiers: list[asyncio.Task[None]]) -> list[TrainingStep]:
    """Take every emitted group as a trainer would (one group per step), failing fast if a tier died."""
    batches: list[TrainingStep] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 90  # a run takes ~7 s on 2 busy cores
    async with StepStream(config, ledger=False) as consumer:
        while len(batches) < EMITTED:
            assert loop.time() < deadline, f"only {len(batches)} of {EMITTED} groups arrived"
            for tier in tiers:
                if tier.done() and tier.exception() is not None:
                    raise tier.exception()  # type: ignore[misc]
            batch = await consumer.next_step(timeout=2)
            if batch is not None:
                batches.append(batch)
                assert await consumer.ack(batch)
    return batches


async def _run_pipeline(config: RollstreamConfig) -> list[TrainingStep]:
    stop = asyncio.Event()
    runs: list[Callable[[RollstreamConfig, asyncio.Event], Awaitable[None]]] = [
        grouping_service.run, reward_service.run, rollout_service.run, producer_service.run]
    tiers = [asyncio.create_task(run(config, stop)) for run in runs]
    try:
        return await _train(config, tiers)
    finally:
        await stop_in_process_tiers(tiers, stop)


def _check_row(batch: TrainingStep, row: int, data: dict[str, Any], tokenizer: Any, model: Any) -> None:
    t = batch.tensors
    expected = {"input_ids": torch.int32, "attention_mask": torch.bool, "loss_mask": torch.int32,
                "logprobs": torch.float32, "versions": torch.int32, "rewards": torch.float32}
    for key, dtype in expected.items():
        assert t[key].dtype == dtype, key
    length = int(t["attention_mask"][row].sum())
    assert bool(t["attention_mask"][row, :length].all())
    ids = t["input_ids"][row, :length].tolist()
    prompt = tokenizer.apply_chat_template(data["messages"], tokenize=True, add_generation_prompt=True, return_dict=False)
    completion = ids[len(prompt):]
    assert ids[: len(prompt)] == prompt and completion, "prompt then completion"
    generated = [0] * len(prompt) + [1] * len(completion)
    assert t["loss_mask"][row, :length].tolist() == generated
    assert t["versions"][row, :length].tolist() == [-1] * len(prompt) + [0] * len(completion)
    assert t["logprobs"][row, : len(prompt)].eq(0).all()
    with torch.no_grad():  # the engine's logprobs, not invented ones: recompute them
        logits = model(torch.tensor([ids])).logits[0].float()
    recomputed = torch.log_softmax(logits[len(prompt) - 1 : length - 1], -1).gather(1, torch.tensor(completion)[:, None])
    torch.testing.assert_close(t["logprobs"][row, len(prompt) : length], recomputed.squeeze(1), atol=1e-4, rtol=0)
    reward = number_reward("", tokenizer.decode(completion), prompt, completion, **data)
    assert float(t["rewards"][row]) == reward


@pytest.mark.parametrize("form", FORMS)
async def test_reference_template_through_the_pipeline(
    form: str, tiny: Path, kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path,
) -> None:
    dataset = tmp_path / "prompts.jsonl"
    rows = _rows()
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _config(kafka_bootstrap, redis_url, unique_name, tiny, dataset, form)
    batches = await _run_pipeline(config)

    names = TopicNames.of(config)
    row_of = {p.task_id: p.index for p in await read_topic(config.kafka, names.prompts, decode_prompt)}
    assert sorted(row_of.values()) == list(range(len(PLAN)))
    outcomes: dict[str, tuple[str, ...]] = {}
    for message in await read_topic(config.kafka, names.batches, decode_group):
        if isinstance(message, GroupDropped):
            outcomes[message.task_id] = (message.reason, message.detail)
        else:
            assert isinstance(message, EmittedGroup)
            episodes = message.group_size - message.rejected - message.failed
            assert len(message.sample_idx) == episodes
            outcomes[message.task_id] = ("batch", str(episodes), str(message.rejected), str(message.failed))
    assert sorted(outcomes) == sorted(row_of), "every prompt ends exactly once"
    for task, outcome in outcomes.items():
        want = PLAN[row_of[task]][2]
        assert outcome[0] == want[0] and (outcome[1:] == want[1:] if want[0] == "batch" else outcome[1].startswith(want[1])), (
            row_of[task], outcome)

    scored = [m for m in await read_topic(config.kafka, names.scored, decode_scored) if isinstance(m, ScoredEpisode)]
    assert scored and all(m.reward_source == "workflow" for m in scored), "the reward tier kept the workflow's rewards"
    redis = connect(config.redis)
    try:
        drops = await StalenessBudget(redis, RedisKeys(names.experiment, names.trial), 0, 16).drops_by_reason()
    finally:
        await redis.aclose()
    assert drops == {"all_rejected": 1, "all_failed": 2}

    tokenizer = workflow_tokenizer(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    assert sorted(task for b in batches for task in b.task_ids) == sorted(t for t, o in outcomes.items() if o[0] == "batch")
    for batch in batches:
        task = batch.task_ids[0]
        assert (batch.group_rejected[0], batch.group_failed[0]) == (int(outcomes[task][2]), int(outcomes[task][3]))
        for row in range(batch.tensors["input_ids"].shape[0]):
            _check_row(batch, row, rows[row_of[task]], tokenizer, model)

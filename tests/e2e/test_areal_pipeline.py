"""AReaL's own workflow classes through the whole pipeline, named in the worker's config.

The tiers as processes on the real broker and Redis (``tests/e2e/test_pipeline.py``'s harness):
three producers, one per workflow key, -> one rollout worker (HFEngine, the tiny model) whose
``rollout.workflows`` name ``areal.workflow.rlvr:RLVRWorkflow``,
``areal.workflow.multi_turn:MultiTurnWorkflow`` and a user's subclass of AReaL's
``RolloutWorkflow`` (``tests/areal_pkg``) with ``"$gconfig"`` / ``"$tokenizer"`` -> reward worker
(``reward_fn: ""``: AReaL's workflows score themselves with AReaL's ``AsyncRewardWrapper``) ->
grouping -> the trainer side, which publishes a new weight version after each step.

Asserts: every admitted prompt ends exactly once; rows are standard; every generated token's
logprob matches a fresh forward pass of the weights of its version (so AReaL's requests reached
the engine and its responses came back whole, across weight updates); each workflow's reward is
the one its AReaL code computes (RLVR: ``answer_reward`` of the decoded completion; multi-turn:
discounted per retry); the user's episodes saw AReaL's workflow context with the task id
rollstream gives them.

A second test does the same with AReaL's ``VisionRLVRWorkflow`` on the tiny VLM
(``"$processor"``): the images travel as files, AReaL's workflow gets PIL images, and the
trainer side's vision inputs reproduce the rollout's logprobs.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from harness.batch_checks import acked_batches, check_batch_tensors, check_logprobs, check_vision_logprobs, unaccounted
from harness.checkpoints import save_versions
from harness.configs import pipeline_config, write_config
from harness.images import noise_png
from harness.ledger import read_topic
from harness.tiers import TierProcess, running, stop_cleanly, tails
from rollstream.areal.workflow import areal_task_id
from rollstream.config import RollstreamConfig, config_from_dict
from rollstream.kafka.topics import TopicNames
from rollstream.testing import tiny_vlm_dir
from rollstream.trainer import StepStream, TrainingStep, VersionPublisher
from rollstream.wire import EmittedGroup, GroupDropped, ScoredEpisode, decode_group, decode_prompt, decode_scored
from tests.areal_pkg.rewards import answer_reward
from tests.reference_libs import import_reference


import_reference("areal")
pytestmark = [pytest.mark.broker, pytest.mark.slow]

GROUP_SIZE = 4
STEP_GROUPS = 4
WORKFLOWS = {
    "areal_rlvr": {"path": "areal.workflow.rlvr:RLVRWorkflow", "kwargs": {
        "reward_fn": "tests.areal_pkg.rewards.answer_reward", "gconfig": "$gconfig", "tokenizer": "$tokenizer"}},
    "areal_multi_turn": {"path": "areal.workflow.multi_turn:MultiTurnWorkflow", "kwargs": {
        "reward_fn": "tests.areal_pkg.rewards.answer_reward", "gconfig": "$gconfig", "tokenizer": "$tokenizer",
        "max_turns": 2, "turn_discount": 0.5}},
    "user": {"path": "tests.areal_pkg.user_workflow.UserWorkflow", "kwargs": {
        "reward_fn": "tests.areal_pkg.rewards.answer_reward", "gconfig": "$gconfig", "tokenizer": "$tokenizer"}},
}
PROMPTS_PER_WORKFLOW = 4
PROMPTS = PROMPTS_PER_WORKFLOW * len(WORKFLOWS)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    from rollstream.tiny.text_model import build_tiny_model, default_corpus

    root = tmp_path_factory.mktemp("areal-e2e-model")
    base = build_tiny_model(root / "v0", default_corpus(), vocab_size=300, hidden_size=32, num_layers=2, num_heads=4)
    return save_versions(base, root, PROMPTS // STEP_GROUPS)


def _tree(name: str, kafka: str, redis_url: str, model: Path, workflows: dict[str, Any], **rollout: Any) -> dict[str, Any]:
    return pipeline_config(
        kafka, redis_url, name, model, trial="areal", staleness={"groups_per_step": STEP_GROUPS, "max_head_offpolicyness": 1},
        rollout={"max_concurrent_rollouts": 4, "gconfig": {"max_new_tokens": 8, "temperature": 1.0},
                 "workflows": workflows, "default_workflow": next(iter(workflows)), **rollout},
        reward={"reward_fn": "", "tokenizer_path": ""},
    )


def _producer_config(tmp: Path, tree: dict[str, Any], key: str, rows: list[dict[str, Any]]) -> Path:
    dataset = tmp / f"{key}.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    producer = {"dataset": str(dataset), "group_size": GROUP_SIZE, "batch_linger_ms": 20, "workflow": key,
                "producer_id": f"p-{key}"}
    return write_config(tmp / f"producer-{key}.yaml", {**tree, "producer": producer})


async def _train(config: RollstreamConfig, tiers: dict[str, TierProcess], groups: int,
                 weights: list[Path] | None) -> list[TrainingStep]:
    """The trainer side until each of ``groups`` is trained, dropped (a group that came late may
    be dropped as stale) or left in a step that cannot fill; a new version after each step when
    ``weights`` are given."""
    batches: list[TrainingStep] = []
    async with StepStream(config, ledger=False) as consumer, VersionPublisher(config) as publisher:
        async for batch in acked_batches(consumer, tiers, groups):
            batches.append(batch)
            if weights is not None:  # the worker reloads: later tokens come from the new weights
                await publisher.publish(len(batches), str(weights[len(batches)]))
        left = unaccounted(consumer, sum(len(b.task_ids) for b in batches), groups)
        assert left == 0, f"{left} of {groups} groups never reached the trainer ({len(batches)} steps)\n{tails(tiers)}"
    return batches


async def _ended_once(config: RollstreamConfig, prompts: int) -> tuple[dict[str, Any], list[EmittedGroup]]:
    """Every admitted prompt ended exactly once; the prompts by task id and the batch records."""
    names = TopicNames.of(config)
    admitted = {m.task_id: m for m in await read_topic(config.kafka, names.prompts, decode_prompt)}
    ended = await read_topic(config.kafka, names.batches, decode_group)
    records = [m for m in ended if isinstance(m, EmittedGroup)]
    tasks = [m.task_id for m in records] + [m.task_id for m in ended if isinstance(m, GroupDropped)]
    assert len(admitted) == prompts and sorted(tasks) == sorted(admitted), "every prompt ends exactly once"
    return admitted, records


async def test_areal_workflows_through_the_pipeline(
    weights: list[Path], kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path,
) -> None:
    tree = _tree(unique_name, kafka_bootstrap, redis_url, weights[0], WORKFLOWS)
    config_path = write_config(tmp_path / "rollstream.yaml", tree)
    config = config_from_dict(tree)
    with running(config_path, tmp_path, ("grouping", "reward-worker", "rollout-worker")) as tiers:
        for w, key in enumerate(WORKFLOWS):
            rows = [{"messages": [{"role": "user", "content": f"What is {i}+{w}?"}], "answer": str(i + w)}
                    for i in range(PROMPTS_PER_WORKFLOW)]
            tiers[f"producer#{key}"] = TierProcess("producer", _producer_config(tmp_path, tree, key, rows),
                                                    tmp_path / f"producer#{key}.log", name=f"producer#{key}").start()
        batches = await _train(config, tiers, PROMPTS, weights)
        stop_cleanly(tiers)

    admitted, records = await _ended_once(config, PROMPTS)
    for batch in batches:
        check_batch_tensors(batch, STEP_GROUPS)
    checked = check_logprobs(batches, weights)
    versions = {int(v) for b in batches for v in b.tensors["versions"].flatten().tolist() if v >= 0}
    print(f"\nareal e2e: {PROMPTS} prompts, {len(batches)} steps, logprobs checked={checked}, versions={sorted(versions)}")
    assert checked > 0 and max(versions) >= 1, "tokens of later versions: the worker followed the trainer"

    tokenizer = AutoTokenizer.from_pretrained(str(weights[0]))
    names = TopicNames.of(config)
    scored = [m for m in await read_topic(config.kafka, names.scored, decode_scored) if isinstance(m, ScoredEpisode)]
    assert scored and all(m.reward_source == "workflow" for m in scored), "AReaL's workflows scored themselves"
    seen = set()
    for message in scored:
        prompt = admitted[message.episode.task_id]
        arrays = {k: v for k, v in _episode_arrays(message).items()}
        ids, loss = arrays["input_ids"][0], arrays["loss_mask"][0]
        completion = tokenizer.decode([int(t) for t, m in zip(ids, loss) if m])
        seen.add(prompt.workflow)
        if prompt.workflow == "areal_rlvr":
            assert message.reward == answer_reward("", completion, [], [], **prompt.data)
        elif prompt.workflow == "areal_multi_turn":  # the last turn's answer, discounted once per retry
            turns = _generated_segments([int(t) for t in ids], [int(m) for m in loss])
            last = answer_reward("", tokenizer.decode(turns[-1]), [], [], **prompt.data)
            assert message.reward == last * 0.5 ** (len(turns) - 1) and 1 <= len(turns) <= 2
        else:  # the user's subclass: AReaL's context told it rollstream's episode, as an int task id
            assert arrays["areal_task_id"].tolist() == [areal_task_id(message.episode.task_id, message.episode.sample_idx)]
            assert arrays["areal_is_eval"].tolist() == [False]
    assert seen == set(WORKFLOWS)


def _generated_segments(ids: list[int], loss: list[int]) -> list[list[int]]:
    """The runs of generated tokens of a row, one per model turn."""
    segments: list[list[int]] = []
    for i, (token, generated) in enumerate(zip(ids, loss)):
        if generated:
            if i == 0 or not loss[i - 1]:
                segments.append([])
            segments[-1].append(token)
    return segments


def _episode_arrays(message: ScoredEpisode) -> dict[str, Any]:
    from rollstream.wire import decode_arrays

    return decode_arrays(message.episode.trajectory)


async def test_areal_vision_workflow_through_the_pipeline(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path,
) -> None:
    model = tiny_vlm_dir()
    workflows = {"areal_vision": {"path": "areal.workflow.vision_rlvr:VisionRLVRWorkflow", "kwargs": {
        "reward_fn": "tests.areal_pkg.rewards.answer_reward", "gconfig": "$gconfig", "tokenizer": "$tokenizer",
        "processor": "$processor", "enable_thinking": False}}}
    tree = _tree(unique_name, kafka_bootstrap, redis_url, model, workflows)
    tree["trainer"]["processor_path"] = str(model)
    config_path = write_config(tmp_path / "rollstream.yaml", tree)
    config = config_from_dict(tree)
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is {}+1?<|im_end|>\n<|im_start|>assistant\n"
    images = {i: noise_png(300 + i, 32 + 4 * i, 40) for i in range(STEP_GROUPS)}
    rows = [{"messages": text.format(i), "images": [base64.b64encode(images[i]).decode()], "answer": str(i + 1)}
            for i in range(STEP_GROUPS)]  # AReaL's datasets: text holding the image placeholder
    with running(config_path, tmp_path, ("grouping", "reward-worker", "rollout-worker")) as tiers:
        tiers["producer"] = TierProcess("producer", _producer_config(tmp_path, tree, "areal_vision", rows),
                                        tmp_path / "producer.log").start()
        batches = await _train(config, tiers, STEP_GROUPS, None)
        stop_cleanly(tiers)

    admitted, _ = await _ended_once(config, STEP_GROUPS)
    images_of = {task: [images[int(prompt.data["answer"]) - 1]] for task, prompt in admitted.items()}
    checked = check_vision_logprobs(batches, model, images_of)
    assert checked > 0 and "mm_token_type_ids" in batches[0].tensors  # AReaL's extra key travelled

"""The example agent through the whole pipeline, as separate processes on the real broker and Redis.

producer -> rollout worker (HFEngine; the calculator agent on the worker's agent endpoint)
-> reward worker -> grouping consumer -> StepStream (this test plays the trainer: it acks
each step and publishes a new weight version, so agents' conversations span weight updates).
22 prompts x 4 samples; the data makes some agents raise or hang (tests/e2e/agent_faults.py).
Asserts: every admitted prompt is accounted for exactly once (an emitted group, or a drop
whose reason names the failure: all samples raised, or all timed out); groups with one failed
sample are emitted with the others and count the failure; rows are multi-turn conversations
with the calculator (one row per episode) whose logprobs match a fresh forward pass of each
token's version within 1e-4; agents never exceeded max_concurrent_rollouts; the staleness
budget was never exceeded; every tier exits 0 on SIGTERM.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from harness.agent_model import agent_base_model, perturbed_copy, tool_model
from harness.batch_checks import check_logprobs
from harness.budget_watch import BudgetWatch
from harness.configs import pipeline_config, write_config
from harness.ledger import read_topic
from harness.tiers import check_alive, running, stop_cleanly, tails
from rollstream.config import RollstreamConfig, config_from_dict
from rollstream.kafka.topics import TopicNames
from rollstream.trainer import StepStream, TrainingStep, VersionPublisher
from rollstream.wire import EmittedGroup, GroupDropped, decode_group, decode_prompt


pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(420)]

PROMPTS = 22
GROUP_SIZE = 4
STEP_GROUPS = 4
ETA = 1
MAX_CONCURRENT = 8
# prompt index -> data["fault"]; the hang comes first so that its timeout overlaps the other prompts' work
FAULTS = {1: "hang", 2: "raise-one", 5: "hang-one", 9: "raise"}
DROPPED = {1: "did not finish within", 9: "RuntimeError: injected fault"}
STEPS = (PROMPTS - len(DROPPED)) // STEP_GROUPS
HANG_TIMEOUT = 15.0  # rollout.agent.timeout_seconds: generous, a busy 2-core machine is slow


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Version 0 calls the calculator; versions 1.. are perturbed copies (distinct weights)."""
    root = tmp_path_factory.mktemp("agent-e2e-model")
    torch.set_num_threads(1)
    tool = tool_model(agent_base_model(root / "base"), root / "v0")
    return [tool] + [perturbed_copy(tool, root / f"v{v}", seed=v, scale=0.01) for v in range(1, STEPS + 1)]


def _write_inputs(tmp: Path, name: str, kafka: str, redis_url: str, model: Path) -> tuple[Path, RollstreamConfig]:
    dataset = tmp / "prompts.jsonl"
    rows = []
    for i in range(PROMPTS):
        a, b = i % 5, i % 4
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "index": i, **({"fault": FAULTS[i]} if i in FAULTS else {})})
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tree = pipeline_config(
        kafka, redis_url, name, model, trial="agent-e2e",
        staleness={"groups_per_step": STEP_GROUPS, "max_head_offpolicyness": ETA},
        producer={"dataset": str(dataset), "group_size": GROUP_SIZE, "batch_linger_ms": 20},
        rollout={
            "max_concurrent_rollouts": MAX_CONCURRENT,
            # Greedy: the model taught one calculator conversation calls the tool on every question.
            "workflows": {"calculator": {"path": "tests.e2e.agent_faults:FaultyCalculator", "kwargs": {
                "record_to": str(tmp / "peak-agents"), "max_tokens": 40, "temperature": 0.0}}},
            "default_workflow": "calculator",
            "agent": {"timeout_seconds": HANG_TIMEOUT},
        },
        # a sample that hangs for HANG_TIMEOUT ends its group steps after its batch mates, more
        # than ETA versions behind: this test counts every group into a step, so none is dropped
        trainer={"drop_stale": False},
    )
    return write_config(tmp / "rollstream.yaml", tree), config_from_dict(tree)


def _check_rows(batch: TrainingStep) -> None:
    t = batch.tensors
    assert t["input_ids"].dtype == torch.int32 and t["rewards"].shape == (t["input_ids"].shape[0],)
    generated = t["loss_mask"].bool()
    assert not (generated & ~t["attention_mask"]).any() and generated.any(dim=1).all()
    assert (t["versions"][~generated] == -1).all() and (t["versions"][generated] >= 0).all()
    assert (t["logprobs"][~generated] == 0).all()
    assert set(t["rewards"].tolist()) <= {0.0, 1.0}
    accepted = [size - failed for size, failed in zip(batch.group_sizes, batch.group_failed)]
    assert t["input_ids"].shape[0] == sum(accepted), "one row per accepted episode: one conversation each"


async def test_agent_pipeline_end_to_end(
    weights: list[Path], kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    config_path, config = _write_inputs(tmp_path, unique_name, kafka_bootstrap, redis_url, weights[0])
    names = TopicNames.of(config)
    batches: list[TrainingStep] = []
    async with BudgetWatch(config, interval=0.1) as budget:
        with running(config_path, tmp_path, ("grouping", "reward-worker", "rollout-worker", "producer")) as tiers:
            async with StepStream(config, ledger=False) as consumer, VersionPublisher(config) as publisher:
                deadline = time.monotonic() + 240
                # Until every group ended: the steps' batches, and the drops (a hang ends late).
                while (len(batches) < STEPS or sum(consumer.drops_by_reason.values()) < len(DROPPED)) \
                        and time.monotonic() < deadline:
                    batch = await consumer.next_step(timeout=5)
                    if batch is None:
                        check_alive(tiers)
                        continue
                    _check_rows(batch)
                    batches.append(batch)
                    assert await consumer.ack(batch)
                    await publisher.publish(len(batches), str(weights[len(batches)]))
                drops = dict(consumer.drops_by_reason)
            assert len(batches) == STEPS, f"only {len(batches)} steps\n{tails(tiers)}"
            stop_cleanly(tiers)

    prompts = {m.task_id: m.data for m in await read_topic(config.kafka, names.prompts, decode_prompt)}
    outcomes = await read_topic(config.kafka, names.batches, decode_group)
    emitted = [m.task_id for m in outcomes if isinstance(m, EmittedGroup)]
    dropped = {m.task_id: m for m in outcomes if isinstance(m, GroupDropped)}
    print(f"\nagent e2e: admitted={len(prompts)} emitted={len(emitted)} dropped={len(dropped)} steps={len(batches)} "
          f"drops={drops}")
    assert len(prompts) == PROMPTS
    assert len(emitted) == len(set(emitted)) and not set(emitted) & set(dropped), "each group ends once"
    assert set(emitted) | set(dropped) == set(prompts), "every admitted prompt is accounted for"
    assert {prompts[tid]["index"]: m.reason for tid, m in dropped.items()} == {i: "all_failed" for i in DROPPED}
    for tid, drop in dropped.items():
        assert DROPPED[prompts[tid]["index"]] in drop.detail, drop.detail
    failed = {prompts[tid]["index"]: f for b in batches for tid, f in zip(b.task_ids, b.group_failed)}
    assert {i: n for i, n in failed.items() if n} == {2: 1, 5: 1}, "one sample failed, the others were trained on"

    assert not budget.exceeded, f"staleness budget exceeded: {budget.worst_sample}"
    peak = int((tmp_path / "peak-agents").read_text())
    assert 2 <= peak <= MAX_CONCURRENT, f"agents running at once: {peak}"
    turns = [int(row.sum()) for b in batches for row in _turn_starts(b)]
    assert max(turns) >= 2, "some agent talked to the model twice (a tool call, then an answer)"
    checked = check_logprobs(batches, weights)
    versions = [sorted({int(v) for v in row.tolist() if v >= 0}) for b in batches for row in b.tensors["versions"]]
    print(f"agent e2e: logprobs checked={checked} max turns={max(turns)} peak agents={peak} "
          f"rows spanning two versions={sum(len(v) > 1 for v in versions)}")
    assert max(max(v) for v in versions) >= 2, "the rollout worker followed the published versions"


def _turn_starts(batch: TrainingStep) -> torch.Tensor:
    """Per row, 1 where a run of generated tokens starts (one per model turn)."""
    mask = batch.tensors["loss_mask"]
    before = torch.nn.functional.pad(mask[:, :-1], (1, 0))
    return (mask == 1) & (before == 0)

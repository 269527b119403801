"""The whole pipeline on a REAL vLLM server: two rollout workers share it, versions land
mid-generation over the wire, the server is killed and restarted mid-run.

producer -> two rollout-worker processes (``rollout.engine: vllm``, one session vLLM server on
CPU, each worker competing for its weight-sync lease) -> reward worker -> grouping -> this test
as the trainer: it acks each step and publishes the next version with the model in hand
(``rollout.weight_transfer: distributed``: the trainer's sender sends the tensors over gloo, a
checkpoint only every other version), which the server's owner has the server receive while
generations run. After the first step the vLLM server is SIGKILLed and started again (it comes
back on its launch weights, version 0: the owner must catch up from the checkpoint before any
worker uses it, then takes the next version over the wire).

Asserted: every admitted prompt ends exactly once (emitted group or counted drop), none of them
as a failure; every generated token's logprob equals a fresh forward pass of the weights of the
version it is tagged with (so no token is mis-tagged, and the logprobs are the served
weights'); versions advance mid-run and some rows span two; the budget is never exceeded; every
tier exits 0 on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from harness.batch_checks import acked_batches, check_batch_tensors, unaccounted
from harness.budget_watch import BudgetWatch
from harness.checkpoints import fresh_server, save_versions
from harness.configs import pipeline_config, write_config
from harness.ledger import read_topic
from harness.logprob_audit import LogprobAuditor
from harness.reports import ShowReport
from harness.tiers import TierProcess, running, stop_cleanly, tails
from rollstream.config import RollstreamConfig, config_from_dict
from rollstream.dev.vllm_server import LocalVLLMServer
from rollstream.kafka.topics import TopicNames
from rollstream.trainer import StepStream, TrainingStep, VersionPublisher
from rollstream.wire import EmittedGroup, GroupDropped, decode_group, decode_prompt


pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = 16
GROUP_SIZE = 4
STEP_GROUPS = 4
STEPS = PROMPTS // STEP_GROUPS
ETA = 1


@pytest.fixture(scope="module")
def weights(vllm_server: LocalVLLMServer, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return save_versions(Path(vllm_server.model), tmp_path_factory.mktemp("vllm-e2e"), STEPS)


def _write_inputs(tmp: Path, name: str, kafka: str, redis_url: str, server: LocalVLLMServer,
                  ) -> tuple[Path, RollstreamConfig]:
    dataset = tmp / "prompts.jsonl"
    rows = [{"prompt": f"What is {i % 5}+{i % 4}? Answer:", "answer": str(i % 5 + i % 4)} for i in range(PROMPTS)]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tree = pipeline_config(
        kafka, redis_url, name, Path(server.model), trial="vllm",
        staleness={"groups_per_step": STEP_GROUPS, "max_head_offpolicyness": ETA},
        producer={"dataset": str(dataset), "group_size": GROUP_SIZE, "batch_linger_ms": 20},
        rollout={"engine": "vllm", "server_urls": [server.url], "tokenizer_path": server.model,
                 "weight_transfer": "distributed", "max_concurrent_rollouts": 4, "shutdown_grace_seconds": 20,
                 "gconfig": {"max_new_tokens": 48, "temperature": 1.0},
                 "server": {"lease_ttl_seconds": 5.0, "reconcile_seconds": 1.0, "version_poll_seconds": 0.2,
                            "health_timeout_seconds": 120}},
    )
    return write_config(tmp / "rollstream.yaml", tree), config_from_dict(tree)


def audit(batches: list[TrainingStep], weights: list[Path]) -> LogprobAuditor:
    checker = LogprobAuditor(weights)
    for step, batch in enumerate(batches):
        t = batch.tensors
        for row in range(t["input_ids"].shape[0]):
            n = int(t["attention_mask"][row].sum())
            checker.row(t["input_ids"][row, :n].tolist(), t["loss_mask"][row, :n].bool().tolist(),
                        t["logprobs"][row, :n].tolist(), t["versions"][row, :n].tolist(), f"step {step} row {row}")
    return checker


async def test_pipeline_on_a_real_vllm_server(
    vllm_server: LocalVLLMServer, weights: list[Path], kafka_bootstrap: str, redis_url: str, unique_name: str,
    tmp_path: Path, show_report: ShowReport,
) -> None:
    await fresh_server(vllm_server)
    config_path, config = _write_inputs(tmp_path, unique_name, kafka_bootstrap, redis_url, vllm_server)
    names = TopicNames.of(config)
    batches: list[TrainingStep] = []
    async with BudgetWatch(config, interval=0.1) as budget:
        with running(config_path, tmp_path, ("grouping", "reward-worker", "rollout-worker", "producer")) as tiers:
            tiers["rollout-worker#2"] = TierProcess("rollout-worker", config_path, tmp_path / "rollout-worker#2.log",
                                                    overrides=["rollout.worker_id=rollout-1"],
                                                    name="rollout-worker#2").start()
            async with StepStream(config, ledger=False) as consumer, VersionPublisher(config) as publisher:
                async for batch in acked_batches(consumer, tiers, PROMPTS, timeout=480):
                    check_batch_tensors(batch, STEP_GROUPS)
                    batches.append(batch)
                    version = len(batches)
                    model = AutoModelForCausalLM.from_pretrained(weights[version])  # the trainer's weights
                    checkpoint = str(weights[version]) if version % 2 else None
                    await publisher.publish(version, checkpoint, model=model)
                    if len(batches) == 1:  # a crash: it comes back on its launch weights
                        vllm_server.kill()
                        await asyncio.to_thread(vllm_server.start)
                # a group that came late (the crash) may be dropped as stale and its step left unfilled
                left = unaccounted(consumer, sum(len(b.task_ids) for b in batches), PROMPTS)
                assert left == 0, f"{left} groups never reached the trainer ({len(batches)} steps)\n{tails(tiers)}"
            stop_cleanly(tiers)

    admitted = {m.task_id for m in await read_topic(config.kafka, names.prompts, decode_prompt)}
    outcomes = await read_topic(config.kafka, names.batches, decode_group)
    emitted = [m for m in outcomes if isinstance(m, EmittedGroup)]
    dropped = [m for m in outcomes if isinstance(m, GroupDropped)]
    figures = f"admitted={len(admitted)} emitted={len(emitted)} dropped={len(dropped)} steps={len(batches)}"
    assert len(admitted) == PROMPTS and not dropped, [(d.task_id, d.reason, d.detail) for d in dropped]
    assert sorted(b.task_id for b in emitted) == sorted(admitted), "every prompt emitted exactly once"
    assert all(b.failed == 0 for b in emitted), "no sample failed, the server's restart included"
    assert not budget.exceeded, f"staleness budget exceeded: {budget.worst_sample}"

    result = audit(batches, weights).result
    show_report(f"{figures}\n{result}")
    assert result.mistagged == 0, result.examples
    assert max(result.versions) >= 2 and result.rows_with_several_versions > 0, result

"""One sample's episode run (no broker): context, stop reason, failures, the recording engine."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from harness.fakes import EchoWorkflow, FakeEngine, make_tokenizer
from rollstream.api.context import workflow_context
from rollstream.api.engine import InferenceEngine
from rollstream.api.io_struct import ModelRequest
from rollstream.api.workflow import RolloutWorkflow
from rollstream.config import RolloutConfig, WorkflowSpec
from rollstream.kafka.topics import TopicNames
from rollstream.rollout_workers.data_copies import copier
from rollstream.rollout_workers.offsets import OffsetTracker
from rollstream.engines.episode_engine import EpisodeEngine
from rollstream.rollout_workers.registry import WorkflowRegistry
from rollstream.rollout_workers.runner import PromptRunner, outcome_of
from rollstream.rollout_workers.tasks import TaskSet
from rollstream.wire import Episode, PromptTask, SampleRejected


seen: list[tuple[str, int, bool, str]] = []


class ContextWorkflow(RolloutWorkflow):
    """Records the episode context, mutates its data, and fails when asked to."""

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Any:
        ctx = workflow_context.get()
        seen.append((ctx.task_id, ctx.sample_idx, ctx.is_eval, workflow_context.stat_scope()))
        data["input_ids"].append(99)  # must not leak into the next sample's data
        if data.get("fail"):
            raise RuntimeError("workflow exploded")
        await engine.agenerate(ModelRequest(input_ids=[3]))
        return await EchoWorkflow().arun_episode(engine, {"input_ids": [3, 4]})


def _runner(engine: InferenceEngine) -> PromptRunner:
    registry = WorkflowRegistry.from_config(
        RolloutConfig(workflows={"ctx": WorkflowSpec(path="tests.unit.test_rollout_runner.ContextWorkflow")}),
        make_tokenizer(),
    )
    return PromptRunner(
        producer=None, names=TopicNames("e", "t"), registry=registry, engine=engine,  # type: ignore[arg-type]
        tracker=OffsetTracker(), claims=None, worker_id="w7", max_concurrent_rollouts=2,  # type: ignore[arg-type]
    )


async def test_roll_sets_context_and_reports_last_stop_reason() -> None:
    seen.clear()
    engine = FakeEngine(outputs=[(10, 2), (11, 12, 13)], stop_reason="length")
    runner = _runner(engine)
    task = PromptTask(task_id="t1", group_size=2, data={"input_ids": [3]}, is_eval=True, workflow="ctx")
    wf = runner._registry.resolve("ctx")
    fresh = copier(task.data)  # what _run_prompt hands each sample
    first = await runner._roll(task, wf, 0, fresh())
    second = await runner._roll(task, wf, 1, fresh())
    assert isinstance(first, Episode) and isinstance(second, Episode)
    assert first.stop_reason == "length" and first.worker_id == "w7"
    assert seen == [("t1", 0, True, "eval-rollout"), ("t1", 1, True, "eval-rollout")]
    assert task.data == {"input_ids": [3]}  # each sample got its own copy
    assert outcome_of(first) == "episode"


async def test_failing_workflow_is_a_failed_sample_not_a_rejection() -> None:
    runner = _runner(FakeEngine())
    task = PromptTask(task_id="t2", group_size=1, data={"input_ids": [3], "fail": True})
    msg = await runner._roll(task, runner._registry.resolve("ctx"), 0, dict(task.data))
    assert isinstance(msg, SampleRejected) and msg.failed
    assert "RuntimeError: workflow exploded" in msg.reason
    assert outcome_of(msg) == "failed"
    assert outcome_of(SampleRejected(task_id="t", sample_idx=0, group_size=1)) == "rejected"


async def test_episode_engine_records_and_delegates() -> None:
    inner = FakeEngine(outputs=[(5, 6, 7)], version=3)
    inner.tokenizer = make_tokenizer()  # type: ignore[attr-defined]
    engine = EpisodeEngine(inner)
    assert engine.stop_reason == "stop" and engine.output_tokens == 0 and engine.last_response is None
    await engine.agenerate(ModelRequest(input_ids=[1]))
    await engine.agenerate(ModelRequest(input_ids=[1]))
    assert engine.output_tokens == 6 and len(engine.responses) == 2
    assert engine.get_version() == 3 and engine.tokenizer is make_tokenizer()
    engine.set_version(4)
    assert inner.get_version() == 4


async def test_task_set_keeps_the_first_failure() -> None:
    tasks = TaskSet()

    async def boom() -> None:
        raise ValueError("first")

    tasks.spawn(boom(), "boom")
    sleeper = tasks.spawn(asyncio.sleep(30), "sleeper")
    assert not await tasks.wait(0.1)
    with pytest.raises(ValueError, match="first"):
        tasks.raise_if_failed()
    assert len(tasks) == 1
    await tasks.cancel_all()
    assert sleeper.cancelled() and len(tasks) == 0

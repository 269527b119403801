"""Interactions, grouping, the agent adapter and the workflow resolution table."""

from __future__ import annotations

import asyncio
import logging

import pytest

from harness.fakes import EchoWorkflow, FakeEngine, SilentAgent, TwoTurnAgent
from rollstream.agent import AgentError, AgentWorkflow
from rollstream.api.context import workflow_context
from rollstream.api.io_struct import ModelRequest, ModelResponse
from rollstream.api.workflow import Interaction, RolloutWorkflow
from rollstream.trajectory.normalize import interactions_to_tensors
from rollstream.trajectory.rows import validate_trajectory
from rollstream.workflows.grouped import GroupedRolloutWorkflow
from rollstream.workflows.resolve import resolve_workflow


DATA = {"input_ids": [1, 2, 3]}


def interaction(prompt: list[int], out: list[int], reward: float | None, reason: str = "stop") -> Interaction:
    resp = ModelResponse(input_tokens=prompt, output_tokens=out, output_logprobs=[-1.0] * len(out),
                         output_versions=[7] * len(out), stop_reason=reason)  # type: ignore[arg-type]
    return Interaction(ModelRequest(input_ids=prompt), resp, reward)


def test_interactions_to_tensors_one_row_each() -> None:
    td = interactions_to_tensors({"a": interaction([1], [5, 6], 2.0), "b": interaction([1, 2, 3], [9], None, "length")})
    validate_trajectory(td)
    assert td["input_ids"].tolist() == [[1, 5, 6, 0], [1, 2, 3, 9]]
    assert td["loss_mask"].tolist() == [[0, 1, 1, 0], [0, 0, 0, 1]]
    assert td["versions"].tolist() == [[-1, 7, 7, -1], [-1, -1, -1, 7]]
    assert td["logprobs"].tolist() == [[0.0, -1.0, -1.0, 0.0], [0.0, 0.0, 0.0, -1.0]]
    assert td["attention_mask"].tolist() == [[True, True, True, False], [True] * 4]
    assert td["rewards"].tolist() == [2.0, 0.0]  # None -> 0.0
    assert td["is_truncated"].tolist() == [False, True]


class Scripted(RolloutWorkflow):
    """Returns results from a list, one per episode, recording each episode's sample_idx."""

    def __init__(self, results: list[object]) -> None:
        self.results = list(results)
        self.sample_idxs: list[int] = []

    async def arun_episode(self, engine, data):  # type: ignore[no-untyped-def]
        self.sample_idxs.append(workflow_context.sample_idx)
        await asyncio.sleep(0)
        return self.results.pop(0)


async def test_group_drops_none_and_pads() -> None:
    engine = FakeEngine(outputs=[[10], [10, 11, 12]])
    group = GroupedRolloutWorkflow(EchoWorkflow(), group_size=3)
    short, long = [await EchoWorkflow().arun_episode(engine, DATA) for _ in range(2)]
    inner = Scripted([None, short, long])
    group.workflow = inner
    td = await group.arun_episode(engine, DATA)
    assert td is not None and td["input_ids"].shape == (2, 6)
    assert td["versions"][0].tolist() == [-1, -1, -1, 0, -1, -1]
    assert sorted(inner.sample_idxs) == [0, 1, 2]


async def test_group_all_none_is_none() -> None:
    group = GroupedRolloutWorkflow(EchoWorkflow(), group_size=4)
    assert await group.arun_episode(FakeEngine(), {**DATA, "reject": True}) is None


async def test_group_sample_idx_follows_outer_index() -> None:
    inner = Scripted([None, None])
    with workflow_context.scope(task_id="t", sample_idx=3):
        await GroupedRolloutWorkflow(inner, 2).arun_episode(FakeEngine(), DATA)
    assert sorted(inner.sample_idxs) == [6, 7]


async def test_group_merges_interaction_dicts() -> None:
    a, b = {"x": interaction([1], [2], 1.0)}, {"y": interaction([1], [3], 0.0)}
    merged = await GroupedRolloutWorkflow(Scripted([a, None, b]), 3).arun_episode(FakeEngine(), DATA)
    assert merged == {**a, **b}


async def test_group_error_cancels_siblings_and_propagates() -> None:
    cancelled = asyncio.Event()

    class Mixed(RolloutWorkflow):
        async def arun_episode(self, engine, data):  # type: ignore[no-untyped-def]
            if workflow_context.sample_idx == 0:
                raise RuntimeError("boom")
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    with pytest.raises(RuntimeError, match="boom"):
        await GroupedRolloutWorkflow(Mixed(), 2).arun_episode(FakeEngine(), DATA)
    assert cancelled.is_set()


def test_group_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        GroupedRolloutWorkflow(EchoWorkflow(), 0)


async def test_agent_engine_calls_are_rows_and_a_float_rewards_the_last() -> None:
    engine = FakeEngine(outputs=[[10, 11], [12]])
    td = await AgentWorkflow(TwoTurnAgent(0.5)).arun_episode(engine, DATA)
    validate_trajectory(td)
    assert td["input_ids"].tolist() == [[1, 2, 3, 10, 11, 0], [1, 2, 3, 10, 11, 12]]  # recorded as sent
    assert td["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    assert td["rewards"].tolist() == [0.0, 0.5]


async def test_agent_dict_reward_maps_ids() -> None:
    td = await AgentWorkflow(TwoTurnAgent({"first": 1.0, "second": 2.0})).arun_episode(FakeEngine(), DATA)
    assert td["rewards"].tolist() == [1.0, 2.0]
    with pytest.raises(KeyError, match="nope"):
        await AgentWorkflow(TwoTurnAgent({"nope": 1.0})).arun_episode(FakeEngine(), DATA)
    with pytest.raises(TypeError, match="must return a float"):
        await AgentWorkflow(TwoTurnAgent("high")).arun_episode(FakeEngine(), DATA)


async def test_agent_without_calls_fails() -> None:
    with pytest.raises(AgentError, match="without calling the model"):
        await AgentWorkflow(SilentAgent()).arun_episode(FakeEngine(), DATA)


# ---- the resolution table -------------------------------------------------------------------

def test_resolve_instance_as_is() -> None:
    wf = EchoWorkflow()
    assert resolve_workflow(wf) is wf


def test_resolve_instance_with_kwargs_warns(caplog: pytest.LogCaptureFixture) -> None:
    wf = EchoWorkflow()
    with caplog.at_level(logging.WARNING, logger="rollstream.workflows.resolve"):
        assert resolve_workflow(wf, {"reward": 2.0}) is wf
    assert "ignoring workflow_kwargs ['reward']" in caplog.text


def test_resolve_class_with_kwargs() -> None:
    wf = resolve_workflow(EchoWorkflow, {"reward": 2.0})
    assert isinstance(wf, EchoWorkflow) and wf.reward == 2.0
    assert isinstance(resolve_workflow(EchoWorkflow, {}), EchoWorkflow)


def test_resolve_class_without_kwargs_is_value_error() -> None:
    with pytest.raises(ValueError, match="EchoWorkflow needs workflow_kwargs"):
        resolve_workflow(EchoWorkflow)


@pytest.mark.parametrize("path", ["harness.fakes.EchoWorkflow", "harness.fakes:EchoWorkflow"])
def test_resolve_import_string_both_forms(path: str) -> None:
    wf = resolve_workflow(path, {"reward": 3.0})
    assert isinstance(wf, EchoWorkflow) and wf.reward == 3.0
    with pytest.raises(ValueError, match="needs workflow_kwargs"):
        resolve_workflow(path)


@pytest.mark.parametrize(
    ("path", "error", "message"),
    [
        ("tests.unit.no_such_module.Thing", ImportError, "cannot import 'tests.unit.no_such_module.Thing'"),
        ("harness.fakes:Missing", ImportError, "'harness.fakes:Missing'.*has no 'Missing'"),
        ("NoDots", ValueError, "'NoDots' must look like"),
        (":Name", ValueError, "must look like"),
        ("harness.fakes.not_a_workflow", TypeError, r"cannot use 'harness.fakes.not_a_workflow' \(imported 42\)"),
    ],
)
def test_resolve_bad_import_string(path: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        resolve_workflow(path)


def test_resolve_agent_object_and_class() -> None:
    agent = TwoTurnAgent()
    wf = resolve_workflow(agent)
    assert isinstance(wf, AgentWorkflow) and wf.agent is agent
    from_class = resolve_workflow(TwoTurnAgent, {"reward": 0.25})
    assert isinstance(from_class, AgentWorkflow) and from_class.agent.reward == 0.25
    assert isinstance(resolve_workflow(TwoTurnAgent).agent, TwoTurnAgent)  # type: ignore[attr-defined]
    assert isinstance(resolve_workflow("harness.fakes:TwoTurnAgent"), AgentWorkflow)


class SyncRun:
    def run(self, data: dict) -> float:  # type: ignore[type-arg]
        return 1.0


@pytest.mark.parametrize("obj", [42, object(), SyncRun(), SyncRun, print])
def test_resolve_invalid_is_type_error(obj: object) -> None:
    with pytest.raises(TypeError, match="cannot use .* as a workflow"):
        resolve_workflow(obj)


async def test_resolve_group_size_wraps() -> None:
    wf = resolve_workflow(EchoWorkflow, {}, group_size=3)
    assert isinstance(wf, GroupedRolloutWorkflow) and wf.group_size == 3
    assert isinstance(resolve_workflow(EchoWorkflow, {}, group_size=1), EchoWorkflow)
    td = await wf.arun_episode(FakeEngine(), DATA)
    assert td is not None and td["input_ids"].shape == (3, 6)
    grouped_agent = await resolve_workflow(TwoTurnAgent(), group_size=2).arun_episode(FakeEngine(), DATA)
    assert grouped_agent is not None  # both members' two engine calls (same rids): none is lost
    assert grouped_agent["input_ids"].shape[0] == 4
    with pytest.raises(ValueError):
        resolve_workflow(EchoWorkflow, {}, group_size=0)

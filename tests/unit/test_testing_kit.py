"""rollstream.testing: the scripted engine keeps the engine contract; check_workflow reports
each sample as a pipeline would; a lazily imported workflow package registers by import string."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollstream.api.engine import WeightUpdate
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest
from rollstream.api.engine import InvalidRequestError
from rollstream.api.workflow import RolloutWorkflow
from rollstream.config import RolloutConfig, WorkflowSpec
from rollstream.testing import Scripted, ScriptedEngine, check_workflow
from rollstream.rollout_workers.registry import WorkflowRegistry
from tests.workflow_pkg.variants import ScriptedTemplate

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def request(ids: object = (1, 2, 3), **gconfig: int) -> ModelRequest:
    return ModelRequest(input_ids=ids, gconfig=GenerationHyperparameters(**gconfig))  # type: ignore[arg-type]


async def test_scripted_outputs_cycle_and_are_cut_to_the_budget() -> None:
    engine = ScriptedEngine([[5, 6, 7], Scripted([8], logprobs=[-2.0], versions=[9], stop_reason="abort")], version=3)
    first, second, third = [await engine.agenerate(request(max_new_tokens=2)) for _ in range(3)]
    assert (first.output_tokens, first.output_versions, first.stop_reason) == ([5, 6], [3, 3], "length")
    assert first.output_logprobs == pytest.approx([-0.5, -0.6]) and first.input_tokens == [1, 2, 3]
    assert (second.output_tokens, second.output_logprobs, second.output_versions, second.stop_reason) == (
        [8], [-2.0], [9], "abort")
    assert third.output_tokens == [5, 6] and len(engine.requests) == 3


async def test_callable_outputs_sync_async_and_raising() -> None:
    async def answer(req: ModelRequest) -> list[int]:
        return [len(req.input_ids)]

    assert (await ScriptedEngine(answer).agenerate(request([4, 4]))).output_tokens == [2]
    assert (await ScriptedEngine(lambda req: Scripted([7], stop_reason="tool_calls")).agenerate(request())).stop_reason == "tool_calls"

    def broken(req: ModelRequest) -> list[int]:
        raise ConnectionError("server gone")

    with pytest.raises(ConnectionError):
        await ScriptedEngine(broken).agenerate(request())
    with pytest.raises(ValueError, match="logprobs has 1 entries for 2 tokens"):
        Scripted([1, 2], logprobs=[0.0])


async def test_requests_are_checked_like_real_engines() -> None:
    engine = ScriptedEngine(vocab_size=50, max_context=6)
    for ids, needle in ((["input_ids", "attention_mask"], "BatchEncoding"), ([1, 99], "vocabulary"), ([1] * 6, "context")):
        with pytest.raises(InvalidRequestError, match=needle):
            await engine.agenerate(request(ids))
    assert (await engine.agenerate(request([1] * 4, max_new_tokens=9))).output_tokens == [10, 11]  # context cap
    assert engine.requests[0].input_ids == [1] * 4  # refused requests are not recorded


async def test_pause_holds_generation_and_tokens_carry_the_version_they_were_made_with() -> None:
    engine = ScriptedEngine([list(range(10, 20))], token_delay=0.02)
    running = asyncio.create_task(engine.agenerate(request()))
    await asyncio.sleep(0.07)
    await engine.pause()
    await engine.update_weights(WeightUpdate(version=1, path="/ckpt/v1"))
    await asyncio.sleep(0.1)
    assert not running.done()
    await engine.resume()
    resp = await running
    assert resp.output_versions[0] == 0 and resp.output_versions[-1] == 1
    assert resp.output_versions == sorted(resp.output_versions)
    assert [u.version for u in engine.weight_updates] == [1] and engine.get_version() == 1


async def test_check_workflow_reports_each_sample_as_the_pipeline_would(tiny_tokenizer, gconfig) -> None:  # type: ignore[no-untyped-def]
    from tests.workflow_pkg import number_reward

    eos = tiny_tokenizer.eos_token_id
    engine = ScriptedEngine([tiny_tokenizer.encode("4") + [eos]], vocab_size=len(tiny_tokenizer))
    data = {"messages": MESSAGES, "answer": "4", "reject": [1], "fail": [2]}
    workflow = ScriptedTemplate(gconfig, tiny_tokenizer, number_reward, form="no_attention_mask")
    with pytest.raises(AssertionError, match="1 of 4 samples failed:\n  sample 2: RuntimeError: scripted failure of sample 2"):
        await check_workflow(workflow, data, engine=engine)
    check = await check_workflow(workflow, data, engine=engine, allow_failures=True)
    assert [s.outcome for s in check.samples] == ["episode", "rejected", "failed", "episode"]
    row = check.episodes[0].tensors
    assert row is not None and row["attention_mask"].dtype == torch.bool and row["rewards"].tolist() == [1.0]
    prompt = tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert row["input_ids"].tolist() == [prompt + tiny_tokenizer.encode("4") + [eos]]
    assert row["versions"].tolist()[0][len(prompt):] == [0, 0]


async def test_check_workflow_names_what_cannot_be_made_standard(scripted_engine: ScriptedEngine) -> None:
    class Agent:
        async def run(self, data: dict, **extra: object) -> float:  # type: ignore[type-arg]
            await extra["engine"].agenerate(ModelRequest(input_ids=[1, 2]))  # type: ignore[attr-defined]
            return 1.0

    class TwoRowsNoMask(RolloutWorkflow):
        async def arun_episode(self, engine, data):  # type: ignore[no-untyped-def]
            return {"input_ids": torch.tensor([[1, 2], [3, 4]])}

    assert len((await check_workflow(Agent(), {}, engine=scripted_engine, n=2)).episodes) == 2
    check = await check_workflow(TwoRowsNoMask(), {}, engine=scripted_engine, n=1, allow_failures=True)
    assert "lacks 'attention_mask'" in (check.failed[0].error or "")
    with pytest.raises(TypeError):
        await check_workflow(Agent(), {"not msgpack": object()}, engine=scripted_engine)


def test_a_lazily_imported_workflow_package_registers_by_import_string(tiny_tokenizer) -> None:  # type: ignore[no-untyped-def]
    lazy = subprocess.run(
        [sys.executable, "-c", "import sys, tests.workflow_pkg as p; print(p.__name__ + '.reference_template' in sys.modules)"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    assert lazy.stdout.strip() == "False", "importing the package must not import its workflows"
    spec = WorkflowSpec(path="tests.workflow_pkg.MyWorkflow", kwargs={
        "gconfig": "$gconfig", "tokenizer": "$tokenizer", "reward_fn": "tests.workflow_pkg.number_reward"})
    registry = WorkflowRegistry.from_config(RolloutConfig(workflows={"mine": spec}, gconfig={"max_new_tokens": 4}), tiny_tokenizer)
    workflow = registry.resolve("mine")
    from tests.workflow_pkg import MyWorkflow, number_reward

    assert isinstance(workflow, MyWorkflow) and workflow.tokenizer is tiny_tokenizer
    assert workflow.gconfig.max_new_tokens == 4 and tiny_tokenizer.eos_token_id in workflow.gconfig.stop_token_ids
    assert workflow.async_reward_fn.reward_fn is number_reward

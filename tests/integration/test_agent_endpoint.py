"""The agent endpoint driven by the official ``openai`` client against HFEngine (tiny model).

Each test runs an agent as the rollout worker does (``AgentWorkflow`` on an ``EpisodeEngine``)
and checks the exported rows against what the engine really returned: the row's tokens are
a response's exact prompt + output, ``loss_mask`` is 1 exactly on the outputs of the turns
the row chains, logprobs and versions are the engine's there and match a fresh forward pass
of the weights of each token's version within 1e-4.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from examples.agent_calculator import CALCULATOR, run_tool

from harness.agent_model import QUESTION, agent_base_model, perturbed_copy, tool_model
from rollstream.agent import AgentEndpoint, AgentWorkflow
from rollstream.api.engine import WeightUpdate
from rollstream.api.io_struct import ModelResponse
from rollstream.engines.episode_engine import EpisodeEngine
from rollstream.config import AgentConfig
from rollstream.engines.hf import HFEngine
from rollstream.trajectory.rows import trajectory_dtypes


pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``base`` (random), ``tool`` (taught the calculator conversation) and its versions 1, 2."""
    root = tmp_path_factory.mktemp("agent-models")
    torch.set_num_threads(1)
    base = agent_base_model(root / "base")
    tool = tool_model(base, root / "tool")
    return {"base": base, "tool": tool, "tool-v1": perturbed_copy(tool, root / "tool-v1", seed=1, scale=0.01),
            "tool-v2": perturbed_copy(tool, root / "tool-v2", seed=2, scale=0.01)}


DEVICE = os.environ.get("ROLLSTREAM_TEST_DEVICE", "cpu")  # e.g. cuda: the same checks on a GPU engine


async def started(path: Path) -> HFEngine:
    engine = HFEngine(str(path), device=DEVICE, seed=0)
    await engine.start()
    return engine


def client(extra: dict[str, Any]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=extra["base_url"], api_key=extra["api_key"],
                              http_client=extra["http_client"], max_retries=0)


async def run_agent(engine: HFEngine, agent: Any, turn_discount: float = 1.0) -> tuple[dict[str, torch.Tensor], list[ModelResponse]]:
    view = EpisodeEngine(engine)
    td = await AgentWorkflow(agent, turn_discount=turn_discount).arun_episode(view, {})
    return td, view.responses


_models: dict[Path, Any] = {}


def check_rows(td: dict[str, torch.Tensor], responses: list[ModelResponse], weights_of: dict[int, Path]) -> None:
    """Every row against the engine's responses and a fresh forward pass (module docstring)."""
    for key, dtype in trajectory_dtypes.items():
        if key in td:
            assert td[key].dtype == dtype, key
    for row in range(td["input_ids"].shape[0]):
        length = int(td["attention_mask"][row].sum())
        ids = td["input_ids"][row, :length].tolist()
        mask = td["loss_mask"][row, :length]
        assert any(r.input_tokens + r.output_tokens == ids for r in responses), "a row is a response's prompt + output"
        expected_mask = torch.zeros(length, dtype=torch.int32)
        logprobs, versions = torch.zeros(length), torch.full((length,), -1, dtype=torch.int32)
        for r in responses:
            if ids[: r.input_len + r.output_len] == r.input_tokens + r.output_tokens:  # a turn of this row
                span = slice(r.input_len, r.input_len + r.output_len)
                expected_mask[span] = 1
                logprobs[span] = torch.tensor(r.output_logprobs)
                versions[span] = torch.tensor(r.output_versions, dtype=torch.int32)
        assert torch.equal(mask, expected_mask), "loss_mask is 1 exactly on the model's tokens"
        assert torch.equal(td["logprobs"][row, :length], logprobs)
        assert torch.equal(td["versions"][row, :length], versions)
        _check_fresh_logprobs(torch.tensor(ids), logprobs, versions, weights_of)


def _check_fresh_logprobs(ids: torch.Tensor, logprobs: torch.Tensor, versions: torch.Tensor,
                          weights_of: dict[int, Path]) -> None:
    for version in sorted({int(v) for v in versions.tolist() if v >= 0}):
        path = weights_of[version]
        model = _models.get(path) or _models.setdefault(path, AutoModelForCausalLM.from_pretrained(path).eval())
        with torch.no_grad():
            logits = model(ids[None].long()).logits[0].float()
        fresh = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None].long()).squeeze(1)
        at = (versions[1:] == version).nonzero().squeeze(1)
        torch.testing.assert_close(logprobs[1:][at], fresh[at], atol=1e-4, rtol=0)


class OneCall:
    def __init__(self) -> None:
        self.completion: Any = None

    async def run(self, data: dict[str, Any], **extra: Any) -> float:
        self.completion = await client(extra).chat.completions.create(
            model="any", messages=QUESTION, max_tokens=12, logprobs=True)
        return 1.0


async def test_single_turn(weights: dict[str, Path]) -> None:
    engine = await started(weights["base"])
    try:
        agent = OneCall()
        td, responses = await run_agent(engine, agent)
    finally:
        await engine.close()
    check_rows(td, responses, {0: weights["base"]})
    (resp,) = responses
    tokenizer = AutoTokenizer.from_pretrained(weights["base"])
    assert resp.input_tokens == tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                                              return_dict=False), "the model's own chat template"
    choice = agent.completion.choices[0]
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(resp.output_logprobs, abs=0)
    assert choice.message.content == tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
    assert td["input_ids"].shape[0] == 1 and td["rewards"].tolist() == [1.0]
    assert set(td["versions"][0].tolist()) == {-1, 0}


class Calculator:
    """Calls the model until it answers without a tool call (greedy, or streamed). Each reply
    goes back as the agent received it, with the test's ``finish_reason`` beside it: keys the
    endpoint does not know do not change how messages compare."""

    def __init__(self, stream: bool = False, between_turns: Any = None) -> None:
        self.stream = stream
        self.between_turns = between_turns  # an async callback run after each turn
        self.replies: list[dict[str, Any]] = []
        self.usage: Any = None

    async def run(self, data: dict[str, Any], **extra: Any) -> float:
        api = client(extra)
        messages: list[Any] = list(QUESTION)
        for _ in range(3):
            reply = await (self._streamed(api, messages) if self.stream else self._plain(api, messages))
            self.replies.append(reply)
            messages.append(reply)
            if self.between_turns is not None:
                await self.between_turns(len(self.replies))
            if not reply.get("tool_calls"):
                break
            for call in reply["tool_calls"]:
                result = run_tool(call["function"]["name"], call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return 1.0 if messages[-1].get("content") == "7" else 0.0

    async def _plain(self, api: openai.AsyncOpenAI, messages: list[Any]) -> dict[str, Any]:
        completion = await api.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR],
                                                       temperature=0, max_tokens=40)
        return {**completion.choices[0].message.model_dump(exclude_none=True),
                "finish_reason": completion.choices[0].finish_reason}

    async def _streamed(self, api: openai.AsyncOpenAI, messages: list[Any]) -> dict[str, Any]:
        stream = await api.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR], temperature=0,
                                                   max_tokens=40, stream=True, stream_options={"include_usage": True})
        content, calls, finish = "", [], None
        async for chunk in stream:
            if chunk.usage is not None:
                self.usage = chunk.usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                calls += [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                          for c in choice.delta.tool_calls or []]
                finish = choice.finish_reason or finish
        reply: dict[str, Any] = {"role": "assistant", "content": content or None, "finish_reason": finish}
        return {**reply, "tool_calls": calls} if calls else reply


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_multi_turn_with_a_tool_call(weights: dict[str, Path], stream: bool) -> None:
    engine = await started(weights["tool"])
    try:
        agent = Calculator(stream=stream)
        td, responses = await run_agent(engine, agent, turn_discount=0.5)
    finally:
        await engine.close()
    first, second = agent.replies
    assert first["finish_reason"] == "tool_calls" and first.get("content") is None
    (call,) = first["tool_calls"]
    assert call["function"]["name"] == "calculator" and json.loads(call["function"]["arguments"]) == {"expression": "3+4"}
    assert second["content"] == "7" and second["finish_reason"] == "stop"
    assert len(responses) == 2
    turn1, turn2 = responses
    assert turn2.input_tokens[: turn1.input_len + turn1.output_len] == turn1.input_tokens + turn1.output_tokens, \
        "the second turn reuses the first turn's exact prompt and output tokens"
    assert td["input_ids"].shape[0] == 1, "one conversation, one row"
    check_rows(td, responses, {0: weights["tool"]})
    assert td["rewards"].tolist() == [0.5], "1.0 discounted once: two model turns"
    if stream:
        assert agent.usage.completion_tokens == turn2.output_len and agent.usage.prompt_tokens == turn2.input_len


class Branches:
    """n=3 on the question, then continue the second choice; rewards set during the episode."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    async def run(self, data: dict[str, Any], **extra: Any) -> Any:
        api, session = client(extra), extra["session"]
        first = await api.chat.completions.create(model="m", messages=QUESTION, n=3, max_tokens=6)
        assert len(first.choices) == 3
        session.set_reward(0.25)  # the last completion: every choice of it
        follow = [*QUESTION, first.choices[1].message, {"role": "user", "content": "sure?"}]
        second = await api.chat.completions.create(model="m", messages=follow, max_tokens=6)
        self.ids = [first.id, second.id]
        return {second.id: 1.0}


async def test_n_choices_are_rows_and_a_continued_choice_extends_its_own(weights: dict[str, Path]) -> None:
    engine = await started(weights["base"])
    try:
        td, responses = await run_agent(engine, Branches(), turn_discount=0.5)
    finally:
        await engine.close()
    assert len(responses) == 4 and td["input_ids"].shape[0] == 3
    check_rows(td, responses, {0: weights["base"]})
    choices, follow_up = responses[:3], responses[3]
    rows = [td["input_ids"][r, : int(td["attention_mask"][r].sum())].tolist() for r in range(3)]
    extended = follow_up.input_tokens + follow_up.output_tokens
    assert rows == [choices[0].input_tokens + choices[0].output_tokens,  # leaves, in the order they were made
                    choices[2].input_tokens + choices[2].output_tokens, extended]
    assert extended[: choices[1].input_len + choices[1].output_len] == choices[1].input_tokens + choices[1].output_tokens
    assert td["rewards"].tolist() == [0.25, 0.25, 0.25 + 0.5 * 1.0]


async def test_weight_updates_mid_conversation_keep_each_tokens_version(weights: dict[str, Path]) -> None:
    """Version 1 is loaded while the first turn generates, version 2 between the turns."""
    engine = await started(weights["tool"])

    async def update(version: int) -> None:
        await engine.pause()
        await engine.update_weights(WeightUpdate(version, str(weights[f"tool-v{version}"])))
        await engine.resume()

    async def mid_first_turn() -> None:
        while engine.stats.tokens_generated < 5:
            await asyncio.sleep(0.001)
        await update(1)

    async def between_turns(turns: int) -> None:
        if turns == 1:
            await update(2)

    updater = asyncio.create_task(mid_first_turn())
    try:
        td, responses = await run_agent(engine, Calculator(between_turns=between_turns))
        await updater
    finally:
        await engine.close()
    turn1, turn2 = responses
    assert turn1.output_versions[0] == 0 and turn1.output_versions[-1] == 1 and sorted(turn1.output_versions) == turn1.output_versions
    assert set(turn2.output_versions) == {2}
    check_rows(td, responses, {0: weights["tool"], 1: weights["tool-v1"], 2: weights["tool-v2"]})
    assert set(td["versions"][0].tolist()) == {-1, 0, 1, 2}


async def test_a_session_key_works_for_its_own_session_only_and_only_while_it_runs(weights: dict[str, Path]) -> None:
    engine = await started(weights["base"])
    endpoint = AgentEndpoint(AgentConfig(model_name="tiny"), engine.tokenizer)
    await endpoint.start()
    try:
        mine, other = endpoint.open_session(EpisodeEngine(engine)), endpoint.open_session(EpisodeEngine(engine))
        own = openai.AsyncOpenAI(base_url=mine.base_url, api_key=mine.api_key, max_retries=0)
        assert [m.id for m in (await own.models.list()).data] == ["tiny"]
        stolen = openai.AsyncOpenAI(base_url=other.base_url, api_key=mine.api_key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await stolen.chat.completions.create(model="m", messages=QUESTION, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            await stolen.models.list()
        await own.chat.completions.create(model="m", messages=QUESTION, max_tokens=2)
        assert len(mine.conversation.turns) == 1 and not other.conversation.turns
        await endpoint.close_session(mine)
        with pytest.raises(openai.AuthenticationError):
            await own.chat.completions.create(model="m", messages=QUESTION, max_tokens=2)
        assert len(mine.conversation.turns) == 1, "nothing is recorded after the episode ended"
        assert mine.base_url.startswith("http://127.0.0.1:")
        await own.close()
        await stolen.close()
    finally:
        await endpoint.close()
        await engine.close()

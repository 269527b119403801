"""Agent episodes end to end on a scripted engine: the example agent under the workflow test
kit, rewards over HTTP, and every way an agent can fail (raise, hang, never call the model)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from examples.agent_calculator import CalculatorAgent
from rollstream.agent import AgentEndpoint, AgentWorkflow
from rollstream.config import AgentConfig
from rollstream.api.io_struct import ModelRequest
from rollstream.testing import ScriptedEngine, check_workflow

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>'
DATA = {"prompt": "3+4=", "answer": "7"}


@pytest.fixture
def engine(tiny_tokenizer: Any) -> ScriptedEngine:
    """Calls the calculator first, then answers with the tool's result."""
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")

    def answer(req: ModelRequest) -> list[int]:
        text = tiny_tokenizer.decode(req.input_ids)
        reply = text.rsplit("<|im_start|>tool\n", 1)[-1].split("<|im_end|>")[0] if "<|im_start|>tool" in text else CALL
        return tiny_tokenizer.encode(reply, add_special_tokens=False) + [im_end]

    return ScriptedEngine(answer, vocab_size=len(tiny_tokenizer), tokenizer=tiny_tokenizer)


def api(extra: dict[str, Any]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=extra["base_url"], api_key=extra["api_key"], http_client=extra["http_client"],
                              max_retries=0)


async def test_the_example_agent_under_the_workflow_test_kit(engine: ScriptedEngine) -> None:
    check = await check_workflow(CalculatorAgent(max_tokens=100), DATA, n=2, engine=engine)
    assert [s.outcome for s in check.samples] == ["episode", "episode"]
    row = check.episodes[0].tensors
    assert row is not None and row["rewards"].tolist() == [1.0] and row["input_ids"].shape[0] == 1
    first, second = check.episodes[0].responses
    assert second.input_tokens[: first.input_len + first.output_len] == first.input_tokens + first.output_tokens


async def test_calculator_agent(scripted_engine: ScriptedEngine) -> None:  # as in docs/WORKFLOWS.md
    check = await check_workflow(CalculatorAgent(), {"prompt": "3+4=", "answer": "7"}, engine=scripted_engine)
    assert len(check.episodes) == 4


class Rewarding:
    """Sets rewards over HTTP while it runs, the way an agent in another process would."""

    async def run(self, data: dict[str, Any], **extra: Any) -> None:
        completion = await api(extra).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        headers = {"Authorization": f"Bearer {extra['api_key']}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            async with http.post(f"{extra['base_url']}/rewards", json={"reward": 0.75, "completion_id": completion.id}) as ok:
                assert ok.status == 200, await ok.text()
            async with http.post(f"{extra['base_url']}/rewards", json={"reward": 1.0, "completion_id": "nope"}) as unknown:
                assert unknown.status == 404 and "nope" in (await unknown.json())["error"]["message"]
            async with http.post(f"{extra['base_url']}/rewards", json={"reward": 1.0},
                                 headers={"Authorization": "Bearer wrong"}) as refused:
                assert refused.status == 401


async def test_rewards_set_over_http_during_the_episode(engine: ScriptedEngine) -> None:
    td = await AgentWorkflow(Rewarding()).arun_episode(engine, {})
    assert td["rewards"].tolist() == [0.75]


class Failing:
    def __init__(self, how: str) -> None:
        self.how = how
        self.cancelled = False

    async def run(self, data: dict[str, Any], **extra: Any) -> float:
        if self.how == "bad request":
            with pytest.raises(openai.BadRequestError):
                await api(extra).chat.completions.create(model="m", messages=[], max_tokens=2)
            raise ValueError("gave up")
        if self.how == "raise":
            await api(extra).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            raise RuntimeError("the tool crashed")
        if self.how == "hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        return 1.0  # "silent": never called the model


@pytest.mark.parametrize(("how", "reason"), [
    ("raise", "RuntimeError: the tool crashed"),
    ("bad request", "ValueError: gave up; the endpoint had answered 400 messages must be a non-empty list"),
    ("hang", "did not finish within 0.2s"),
    ("silent", "without calling the model"),
])
async def test_a_failing_agent_fails_its_sample_with_the_reason(engine: ScriptedEngine, how: str, reason: str) -> None:
    agent = Failing(how)
    workflow = AgentWorkflow(agent, timeout_seconds=0.2)
    check = await check_workflow(workflow, DATA, n=1, engine=engine, allow_failures=True)
    (sample,) = check.samples
    assert sample.outcome == "failed" and reason in (sample.error or ""), sample.error
    assert agent.cancelled == (how == "hang")


class Blocked:
    """Leaves a request generating when it returns: the session's end must cancel it."""

    def __init__(self) -> None:
        self.late: asyncio.Task[Any] | None = None

    async def run(self, data: dict[str, Any], **extra: Any) -> float:
        await api(extra).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        own = openai.AsyncOpenAI(base_url=extra["base_url"], api_key=extra["api_key"], max_retries=0)
        self.late = asyncio.ensure_future(own.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "again"}], max_tokens=1000))
        await asyncio.sleep(0.2)  # the late request is generating now
        return 1.0


async def test_requests_still_generating_when_the_episode_ends_are_cancelled_and_not_recorded(tiny_tokenizer: Any) -> None:
    slow = ScriptedEngine([[5] * 1000], token_delay=0.05, vocab_size=len(tiny_tokenizer), tokenizer=tiny_tokenizer)
    endpoint = AgentEndpoint(AgentConfig(), tiny_tokenizer)
    agent = Blocked()
    try:
        td = await AgentWorkflow(agent, endpoint=endpoint).arun_episode(slow, {})
        assert td["input_ids"].shape[0] == 1, "only the answered request is a row"
        assert agent.late is not None
        with pytest.raises(openai.APIStatusError) as info:
            await asyncio.wait_for(agent.late, 20)  # the scripted answer alone would take 50 s
        assert info.value.status_code == 410 and len(endpoint) == 0
    finally:
        await endpoint.close()


async def test_an_unknown_reward_id_or_type_fails_the_episode(engine: ScriptedEngine) -> None:
    class Returns:
        def __init__(self, value: Any) -> None:
            self.value = value

        async def run(self, data: dict[str, Any], **extra: Any) -> Any:
            await api(extra).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            return self.value

    with pytest.raises(KeyError, match="did not produce"):
        await AgentWorkflow(Returns({"chatcmpl-unknown": 1.0})).arun_episode(engine, {})
    with pytest.raises(TypeError, match="must return a float"):
        await AgentWorkflow(Returns("high")).arun_episode(engine, {})
    assert (await AgentWorkflow(Returns(True)).arun_episode(engine, {}))["rewards"].tolist() == [1.0]

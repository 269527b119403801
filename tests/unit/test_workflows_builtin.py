"""Built-in workflows: RLVR and multi-turn retry against a fake engine (vision RLVR: test_vision_workflow.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.fakes import FakeEngine, ids, make_tokenizer
from rollstream.api.context import workflow_context
from rollstream.api.io_struct import GenerationHyperparameters
from rollstream.runtime.stats import stats_tracker
from rollstream.trajectory.rows import trajectory_dtypes, validate_trajectory
from rollstream.workflows.multi_turn import MultiTurnWorkflow
from rollstream.workflows.rlvr import RLVRWorkflow
from tests.unit import reward_fns


TOK = make_tokenizer()
EOS = TOK.eos_token_id
GCONFIG = GenerationHyperparameters(max_new_tokens=8, max_tokens=64)
QUESTION = [{"role": "user", "content": "what is two plus three"}]


def chat_ids(messages: list[dict[str, str]]) -> list[int]:
    return TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


async def five_reward(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any
) -> float:
    return 1.0 if "five" in completion.split() else 0.0


def check_row(td: dict[str, torch.Tensor], prompt_len: int, out_len: int, version: int) -> None:
    validate_trajectory(td)
    assert td["input_ids"].shape == (1, prompt_len + out_len)
    for key in ("input_ids", "loss_mask", "logprobs", "versions", "attention_mask", "is_truncated"):
        assert td[key].dtype == trajectory_dtypes[key], key
    assert td["loss_mask"].tolist() == [[0] * prompt_len + [1] * out_len]
    assert td["versions"].tolist() == [[-1] * prompt_len + [version] * out_len]
    assert td["logprobs"][0, :prompt_len].eq(0.0).all() and td["logprobs"][0, prompt_len:].lt(0).all()
    assert td["attention_mask"].all()


async def test_rlvr_without_reward_fn_has_no_rewards_key() -> None:
    engine = FakeEngine(outputs=[ids("the answer is five") + [EOS]], version=4)
    wf = RLVRWorkflow(GCONFIG, TOK)
    td = await wf.arun_episode(engine, {"input_ids": [5, 6, 7]})
    check_row(td, prompt_len=3, out_len=5, version=4)
    assert "rewards" not in td and td["is_truncated"].tolist() == [False]
    assert td["input_ids"][0, :3].tolist() == [5, 6, 7]
    req = engine.requests[0]
    assert req.gconfig.stop_token_ids == [TOK.pad_token_id, EOS] and req.gconfig.n_samples == 1


async def test_rlvr_uses_chat_template_then_plain_prompt() -> None:
    engine = FakeEngine(outputs=[ids("five")])
    await RLVRWorkflow(GCONFIG, TOK).arun_episode(engine, {"messages": QUESTION})
    assert engine.requests[0].input_ids == chat_ids(QUESTION)
    plain = make_tokenizer(chat_template=False)
    await RLVRWorkflow(GCONFIG, plain).arun_episode(engine, {"messages": QUESTION, "prompt": "hello world"})
    assert engine.requests[1].input_ids == ids("hello world")
    with pytest.raises(ValueError, match="cannot build a prompt"):
        await RLVRWorkflow(GCONFIG, plain).arun_episode(engine, {"messages": QUESTION})


async def test_rlvr_truncated_output_is_flagged() -> None:
    engine = FakeEngine(outputs=[ids("the answer is five")])
    td = await RLVRWorkflow(GCONFIG.new(max_new_tokens=2), TOK).arun_episode(engine, {"input_ids": [5]})
    assert td["input_ids"].shape == (1, 3) and td["is_truncated"].tolist() == [True]


async def test_rlvr_async_reward_and_stats() -> None:
    stats_tracker.export()
    engine = FakeEngine(outputs=[ids("five") + [EOS], ids("four") + [EOS]])
    wf = RLVRWorkflow(GCONFIG, TOK, reward_fn=five_reward)
    right = await wf.arun_episode(engine, {"messages": QUESTION})
    with workflow_context.scope(task_id="e", is_eval=True):
        wrong = await wf.arun_episode(engine, {"messages": QUESTION})
    assert right["rewards"].tolist() == [1.0] and right["rewards"].dtype == torch.float32
    assert wrong["rewards"].tolist() == [0.0]
    stats = stats_tracker.export()
    assert stats["rollout/reward/mean"] == 1.0 and stats["eval-rollout/reward/mean"] == 0.0


async def test_rlvr_sync_reward_runs_in_process_pool() -> None:
    plain = make_tokenizer(chat_template=False)
    engine = FakeEngine(outputs=[ids("five") + [EOS]])
    wf = RLVRWorkflow(GCONFIG, plain, reward_fn=reward_fns.answer_in_completion, reward_max_workers=1)
    try:
        # data has a "prompt" key, like the reward function's first parameter: must not collide
        td = await wf.arun_episode(engine, {"prompt": "what is two plus three", "answer": "five"})
    finally:
        await wf.aclose()
    assert td["rewards"].tolist() == [1.0]


def test_rlvr_refuses_unpicklable_reward() -> None:
    with pytest.raises(TypeError, match="must be picklable"):
        RLVRWorkflow(GCONFIG, TOK, reward_fn=lambda *a, **k: 1.0)


def multi_turn(**kw: Any) -> MultiTurnWorkflow:
    args: dict[str, Any] = {"reward_fn": five_reward, "max_turns": 3, "turn_discount": 0.5, "retry_prompt": "try again"}
    return MultiTurnWorkflow(GCONFIG, TOK, **{**args, **kw})


async def test_multi_turn_retries_until_correct_with_discount() -> None:
    wrong, right = ids("four"), ids("five") + [EOS]
    engine = FakeEngine(outputs=[wrong, right], version=2)
    wf = multi_turn()
    td = await wf.arun_episode(engine, {"messages": QUESTION})
    validate_trajectory(td)
    prompt = engine.requests[0].input_ids
    between = [EOS] + wf.retry_prompt_ids  # the wrong answer lacked eos, so one is added
    assert wf.retry_prompt_ids == chat_ids([{"role": "user", "content": "try again"}])
    assert engine.requests[1].input_ids == prompt + wrong + between
    assert td["input_ids"].tolist() == [prompt + wrong + between + right]
    n_p, n_b = len(prompt), len(between)
    assert td["loss_mask"].tolist() == [[0] * n_p + [1] + [0] * n_b + [1, 1]]
    assert td["versions"].tolist() == [[-1] * n_p + [2] + [-1] * n_b + [2, 2]]
    assert td["logprobs"][0, n_p + 1 : n_p + 1 + n_b].eq(0.0).all()
    assert td["rewards"].tolist() == [0.5]  # one retry: 1.0 * 0.5
    assert engine.requests[0].rid == engine.requests[1].rid


async def test_multi_turn_stops_at_max_turns_and_on_first_success() -> None:
    engine = FakeEngine(outputs=[ids("four") + [EOS]])
    td = await multi_turn(max_turns=3).arun_episode(engine, {"messages": QUESTION})
    assert len(engine.requests) == 3 and td["rewards"].tolist() == [0.0]
    assert td["loss_mask"].sum().item() == 6  # three answers of two tokens each
    first_try = FakeEngine(outputs=[ids("five")])
    td = await multi_turn().arun_episode(first_try, {"messages": QUESTION})
    assert len(first_try.requests) == 1 and td["rewards"].tolist() == [1.0]


async def test_multi_turn_stops_when_budget_runs_out() -> None:
    engine = FakeEngine(outputs=[ids("four three two one")[:3]])
    wf = multi_turn(max_turns=10, turn_discount=1.0)
    wf.gconfig = wf.gconfig.new(max_tokens=len(chat_ids(QUESTION)) + 8)  # room for one turn only
    td = await wf.arun_episode(engine, {"messages": QUESTION})
    assert len(engine.requests) == 1 and td["rewards"].tolist() == [0.0]


def test_multi_turn_validates_settings() -> None:
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"turn_discount must be in \(0, 1\]"):
            multi_turn(turn_discount=bad)
    with pytest.raises(ValueError, match="max_turns"):
        multi_turn(max_turns=0)
    with pytest.raises(ValueError, match="needs reward_fn"):
        multi_turn(reward_fn=None)
    assert multi_turn(turn_discount=1.0).turn_discount == 1.0


def test_multi_turn_retry_prompt_without_chat_template() -> None:
    plain = make_tokenizer(chat_template=False)
    wf = MultiTurnWorkflow(
        GCONFIG, plain, reward_fn=five_reward, max_turns=2, turn_discount=0.9, retry_prompt="try again"
    )
    assert wf.retry_prompt_ids == ids("try again")


async def test_multi_turn_records_final_reward_and_turns() -> None:
    stats_tracker.export()
    await multi_turn().arun_episode(FakeEngine(outputs=[ids("four"), ids("five")]), {"messages": QUESTION})
    stats = stats_tracker.export()
    assert stats["rollout/reward/mean"] == 0.5 and stats["rollout/turns/mean"] == 2.0

"""Splitting trajectories and scoring episodes (no broker).

The reward functions the real process pool runs live in ``tests/unit/reward_fns.py``, which
imports nothing heavy: a worker process imports a function's module inside the call's timeout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from rollstream.config import ConfigError, RewardConfig
from rollstream.reward_workers.reward_function import Scorer, load_tokenizer
from rollstream.reward_workers.scoring import score_message, split_prompt_completion
from rollstream.rewards.pool import RewardTimeout
from rollstream.rewards.wrapper import AsyncRewardWrapper
from rollstream.wire import Episode, SampleRejected, ScoredEpisode, TaskFailed, decode_episode, decode_scored, encode
from rollstream.wire.torch_tensors import decode_tensor_dict, encode_tensor_dict
from tests.unit.reward_fns import raising_reward, sleeping_reward


def trajectory(rows: list[tuple[list[int], list[int]]], rewards: list[float] | None = None) -> dict[str, torch.Tensor]:
    """A right-padded ``[b, L]`` trajectory from (token ids, loss mask) rows."""
    length = max(len(ids) for ids, _ in rows)
    pad = lambda xs, v: xs + [v] * (length - len(xs))  # noqa: E731
    traj = {
        "input_ids": torch.tensor([pad(ids, 0) for ids, _ in rows], dtype=torch.int32),
        "attention_mask": torch.tensor([pad([1] * len(ids), 0) for ids, _ in rows], dtype=torch.bool),
        "loss_mask": torch.tensor([pad(mask, 0) for _, mask in rows], dtype=torch.int32),
        "logprobs": torch.tensor([pad([-0.5 * m for m in mask], 0) for _, mask in rows], dtype=torch.float32),
        "versions": torch.tensor([pad([0 if m else -1 for m in mask], -1) for _, mask in rows], dtype=torch.int32),
    }
    if rewards is not None:
        traj["rewards"] = torch.tensor(rewards, dtype=torch.float32)
    return traj


def episode(traj: dict[str, torch.Tensor], **kw: Any) -> Episode:
    """An Episode as a reward worker sees it: decoded from bytes (read-only tensor views)."""
    fields: dict[str, Any] = {"task_id": "p:0:0", "sample_idx": 1, "group_size": 2, "data": {"answer": "7"}}
    fields.update(kw)
    decoded = decode_episode(encode(Episode(trajectory=encode_tensor_dict(traj), **fields)))
    assert isinstance(decoded, Episode)
    return decoded


SINGLE = trajectory([([10, 11, 12, 20, 21, 2], [0, 0, 0, 1, 1, 1])])


def as_lists(ids: tuple[numpy.ndarray, numpy.ndarray]) -> tuple[list[int], list[int]]:
    return ids[0].tolist(), ids[1].tolist()


def test_split_single_turn_drops_padding() -> None:
    traj = trajectory([([10, 11, 20], [0, 0, 1]), ([10, 11, 12, 20, 21], [0, 0, 0, 1, 1])])
    assert as_lists(split_prompt_completion(traj, 0)) == ([10, 11], [20])
    assert as_lists(split_prompt_completion(traj, 1)) == ([10, 11, 12], [20, 21])


def test_split_multi_turn_completion_is_every_generated_token() -> None:
    # prompt | turn 1 | user feedback | turn 2
    traj = trajectory([([10, 11, 20, 21, 30, 31, 22], [0, 0, 1, 1, 0, 0, 1])])
    assert as_lists(split_prompt_completion(traj)) == ([10, 11], [20, 21, 22])


def test_split_without_generated_tokens_is_all_prompt() -> None:
    traj = trajectory([([10, 11], [0, 0])])
    assert as_lists(split_prompt_completion(traj)) == ([10, 11], [])
    no_mask = {k: v for k, v in traj.items() if k != "loss_mask"}
    assert as_lists(split_prompt_completion(no_mask)) == ([10, 11], [])


class FakeScorer:
    """A RewardScorer with a scripted outcome; records every call."""

    def __init__(self, outcome: float | BaseException, on_timeout: str = "zero", rescore: bool = False) -> None:
        self.outcome = outcome
        self.on_timeout = on_timeout
        self.worker_id = "w-test"
        self.rescore = rescore
        self.calls: list[tuple[str, str, list[int], list[int], dict[str, Any]]] = []
        self.passed: list[Episode] = []

    def passed_through(self, episode: Episode) -> None:
        self.passed.append(episode)

    def decode(self, ids: numpy.ndarray) -> str:
        return " ".join(f"t{i}" for i in ids.tolist())

    def decode_prompt(self, ids: numpy.ndarray) -> str:
        return self.decode(ids)

    async def reward(self, prompt: str, completion: str, prompt_ids: numpy.ndarray, completion_ids: numpy.ndarray,
                     data: dict[str, Any]) -> float:
        self.calls.append((prompt, completion, prompt_ids.tolist(), completion_ids.tolist(), data))
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


async def test_episode_is_scored_with_rewards_in_its_trajectory() -> None:
    scorer = FakeScorer(0.75)
    ep = episode(SINGLE, data={"answer": "7", "prompt": "clashes with an argument name"})
    result = await score_message(ep, scorer)
    assert isinstance(result, ScoredEpisode)
    assert result.reward == 0.75 and result.scored_by == "w-test" and result.scored_at > 0
    assert scorer.calls == [("t10 t11 t12", "t20 t21 t2", [10, 11, 12], [20, 21, 2], {"answer": "7"})]
    tensors = decode_tensor_dict(result.episode.trajectory)
    assert tensors["rewards"].dtype == torch.float32 and tensors["rewards"].tolist() == [0.75]
    for key, value in SINGLE.items():
        assert torch.equal(tensors[key], value)
    assert "rewards" not in ep.trajectory  # the input episode is untouched
    # And it survives the wire as a valid scored message.
    decoded = decode_scored(encode(result))
    assert isinstance(decoded, ScoredEpisode) and decoded.episode.task_id == "p:0:0"


async def test_batch_rows_are_scored_each_and_averaged() -> None:
    traj = trajectory([([10, 20], [0, 1]), ([10, 11, 21], [0, 0, 1])])
    result = await score_message(episode(traj), FakeScorer(1.0))
    assert isinstance(result, ScoredEpisode)
    assert decode_tensor_dict(result.episode.trajectory)["rewards"].tolist() == [1.0, 1.0]


async def test_has_reward_keeps_the_workflow_reward() -> None:
    scorer = FakeScorer(0.0)
    ep = episode(trajectory([([10, 20], [0, 1])], rewards=[0.25]), has_reward=True)
    result = await score_message(ep, scorer)
    assert isinstance(result, ScoredEpisode) and result.reward == 0.25
    assert result.reward_source == "workflow" and scorer.passed == [ep]
    assert scorer.calls == []


async def test_rescore_calls_the_reward_fn_for_episodes_the_workflow_scored() -> None:
    scorer = FakeScorer(0.75, rescore=True)
    result = await score_message(episode(trajectory([([10, 20], [0, 1])], rewards=[0.25]), has_reward=True), scorer)
    assert isinstance(result, ScoredEpisode) and result.reward == 0.75 and result.reward_source == "reward_fn"
    assert decode_tensor_dict(result.episode.trajectory)["rewards"].tolist() == [0.75]
    assert len(scorer.calls) == 1 and scorer.passed == []


async def test_has_reward_without_rewards_is_a_failed_rejection() -> None:
    result = await score_message(episode(SINGLE, has_reward=True), FakeScorer(0.0))
    assert isinstance(result, SampleRejected) and result.failed and result.reason.startswith("reward_error:")


async def test_rejections_and_failures_pass_through_unchanged() -> None:
    scorer = FakeScorer(1.0)
    rejected = SampleRejected(task_id="p:0:1", sample_idx=0, group_size=2, reason="workflow_none")
    failed = TaskFailed(task_id="p:0:2", group_size=2, reason="bad prompt")
    assert await score_message(rejected, scorer) is rejected
    assert await score_message(failed, scorer) is failed
    assert scorer.calls == []


async def test_timeout_policy_zero_and_reject() -> None:
    zero = await score_message(episode(SINGLE), FakeScorer(RewardTimeout("slow"), on_timeout="zero"))
    assert isinstance(zero, ScoredEpisode) and zero.reward == 0.0
    reject = await score_message(episode(SINGLE, sample_idx=0), FakeScorer(RewardTimeout("slow"), on_timeout="reject"))
    assert reject == SampleRejected(task_id="p:0:0", sample_idx=0, group_size=2, reason="reward_timeout", failed=False)


async def test_reward_error_and_non_finite_reward_are_failed_rejections() -> None:
    error = await score_message(episode(SINGLE), FakeScorer(ValueError("boom")))
    assert isinstance(error, SampleRejected) and error.failed
    assert error.reason == "reward_error: ValueError: boom"
    nan = await score_message(episode(SINGLE), FakeScorer(float("nan")))
    assert isinstance(nan, SampleRejected) and nan.failed and "non-finite" in nan.reason


def make_scorer(fn: Any, on_timeout: str = "zero", timeout: float = 30.0, tokenizer: Any = None) -> Scorer:
    wrapper = AsyncRewardWrapper(fn, timeout_seconds=timeout, max_retries=0, max_workers=1)
    return Scorer(wrapper, tokenizer, on_timeout, "w-pool")  # type: ignore[arg-type]


@pytest.mark.timeout(120)
async def test_timeout_then_reject_through_the_process_pool() -> None:
    """A reward fn sleeping past a tiny timeout: "reject" rejects, "zero" scores 0.0."""
    for policy, expected in (("reject", SampleRejected), ("zero", ScoredEpisode)):
        scorer = make_scorer(sleeping_reward, on_timeout=policy, timeout=0.5)
        try:
            result = await score_message(episode(SINGLE), scorer)
        finally:
            await scorer.aclose()
        assert isinstance(result, expected)
        if isinstance(result, SampleRejected):
            assert (result.reason, result.failed) == ("reward_timeout", False)
        else:
            assert result.reward == 0.0


@pytest.mark.timeout(120)
async def test_real_reward_fn_and_error_through_the_process_pool(tmp_path: Path) -> None:
    from rollstream.rewards import exact_match_reward
    from harness.fakes import ids, make_tokenizer

    make_tokenizer().save_pretrained(tmp_path / "tok")
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    prompt, answer = ids("what is two plus five"), ids("the answer is five") + [2]
    traj = trajectory([(prompt + answer, [0] * len(prompt) + [1] * len(answer))])
    good = make_scorer(exact_match_reward, tokenizer=tokenizer)
    bad = make_scorer(raising_reward)
    try:
        assert good.decode(answer) == "the answer is five <eos>"  # special tokens kept
        right = await score_message(episode(traj, data={"answer": "five"}), good)
        wrong = await score_message(episode(traj, data={"answer": "four"}), good)
        failed = await score_message(episode(traj), bad)
    finally:
        await good.aclose()
        await bad.aclose()
    assert isinstance(right, ScoredEpisode) and right.reward == 1.0
    assert isinstance(wrong, ScoredEpisode) and wrong.reward == 0.0  # a genuine 0.0, not a timeout
    assert isinstance(failed, SampleRejected) and failed.failed
    assert failed.reason == "reward_error: ValueError: reward exploded"


class CountingTokenizer:
    """The real tokenizer, counting its decodes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decodes = 0

    def decode(self, ids: Any, **kw: Any) -> str:
        self.decodes += 1
        return self.tokenizer.decode(ids, **kw)


@pytest.mark.timeout(120)
async def test_a_group_decodes_its_prompt_once_and_the_pool_gets_texts_and_lists() -> None:
    from harness.fakes import ids, make_tokenizer
    from tests.unit.reward_fns import texts_and_ids_arrive

    tokenizer = CountingTokenizer(make_tokenizer())
    prompt = ids("what is two plus three")
    completions = ["five", "the answer is five", "four", "hello world", "five five", "again", "wrong", "try please"]
    scorer = make_scorer(texts_and_ids_arrive, tokenizer=tokenizer)
    try:
        results = [await score_message(episode(
            trajectory([(prompt + ids(words), [0] * len(prompt) + [1] * len(words.split()))]), sample_idx=i,
            group_size=8, data={"expected": f"what is two plus three | {words}"}), scorer)
            for i, words in enumerate(completions)]
        other = await score_message(episode(trajectory([(ids("hello") + ids("world"), [0, 1])]),
                                            data={"expected": "hello | world"}), scorer)
    finally:
        await scorer.aclose()
    assert [r.reward for r in results] == [1.0] * 8 and isinstance(other, ScoredEpisode) and other.reward == 1.0
    assert tokenizer.decodes == 1 + 8 + 2  # the shared prompt once, each completion, the other episode's two


async def test_without_a_reward_fn_pre_scored_episodes_pass_and_others_fail_saying_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scorer = Scorer.from_config(RewardConfig(reward_fn=""), "w")
    pre = episode(trajectory([([10, 20], [0, 1])], rewards=[0.5]), has_reward=True)
    kept = await score_message(pre, scorer)
    unscored = await score_message(episode(SINGLE), scorer)
    await scorer.aclose()
    assert isinstance(kept, ScoredEpisode) and kept.reward == 0.5 and kept.reward_source == "workflow"
    assert isinstance(unscored, SampleRejected) and unscored.failed
    assert "reward.reward_fn is empty" in unscored.reason and "NoRewardFunctionError" in unscored.reason
    assert scorer.passed_through_count == 1 and "NOT called" not in caplog.text  # no function: nothing to warn about
    with pytest.raises(ConfigError, match="reward.rescore"):
        Scorer.from_config(RewardConfig(reward_fn="", rescore=True), "w")


async def test_passing_through_with_a_reward_fn_warns_once_naming_rescore(caplog: pytest.LogCaptureFixture) -> None:
    scorer = make_scorer(raising_reward)
    scorer.reward_fn_name = "tests.unit.reward_fns:raising_reward"
    pre = episode(trajectory([([10, 20], [0, 1])], rewards=[0.5]), has_reward=True)
    try:
        results = [await score_message(pre, scorer) for _ in range(3)]
    finally:
        await scorer.aclose()
    assert all(isinstance(r, ScoredEpisode) and r.reward_source == "workflow" for r in results)
    warnings = [r for r in caplog.records if "reward.rescore=true" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"
    assert "raising_reward NOT called" in warnings[0].getMessage()


def test_scorer_from_config_errors_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="reward.tokenizer_path"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="not allow-listed|cannot import"):
        Scorer.from_config(RewardConfig(reward_fn="nope_mod:fn"), "w")
    assert load_tokenizer("") is None

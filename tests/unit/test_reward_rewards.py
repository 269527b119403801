"""Built-in reward functions and reward function resolution (no broker)."""

from __future__ import annotations

import pickle

import pytest

from rollstream.rewards import exact_match_reward, math_verify_reward
from rollstream.reward_workers.reward_function import resolve_reward_fn
from rollstream.config import ConfigError


def exact(completion: str, answer: object) -> float:
    return exact_match_reward("question", completion, [1, 2], [3], answer=answer)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("The answer is 7.", "7", 1.0),
        ("  7  ", "7", 1.0),
        ("**7**", "7", 1.0),
        ("7<|im_end|>", "7", 1.0),
        ("so it is 42", 42, 1.0),  # non-string answers compare by their text
        ("x = 3.5 then", " 3.5 ", 1.0),  # the answer is stripped
        ("17", "7", 0.0),
        ("70 apples", "7", 0.0),
        ("7b", "7", 0.0),
        ("13.5", "3.5", 0.0),
        ("Paris", "paris", 0.0),  # case-sensitive
        ("anything", "", 0.0),
        ("anything", None, 0.0),
    ],
)
def test_exact_match(completion: str, answer: object, expected: float) -> None:
    assert exact(completion, answer) == expected


def test_exact_match_without_answer_key() -> None:
    assert exact_match_reward("q", "7", [], []) == 0.0


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("\\boxed{7}", "7", 1.0),
        ("The final answer is $\\boxed{7}$.", "7", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{8}", "7", 0.0),
        ("no math at all", "7", 0.0),
        ("", "7", 0.0),
        ("\\boxed{7}", "", 0.0),
        ("\\boxed{7}", "\\frac{", 0.0),  # unparsable gold answer
    ],
)
def test_math_verify(completion: str, answer: str, expected: float) -> None:
    pytest.importorskip("math_verify")
    assert math_verify_reward("q", completion, [], [], answer=answer) == expected


def test_reward_functions_pickle_by_reference() -> None:
    for fn in (exact_match_reward, math_verify_reward):
        assert pickle.loads(pickle.dumps(fn)) is fn


def test_resolve_both_import_string_forms() -> None:
    colon = "rollstream.rewards:exact_match_reward"
    dotted = "rollstream.rewards.math_verify_reward"
    assert resolve_reward_fn(colon, [colon]) is exact_match_reward
    assert resolve_reward_fn(dotted, {dotted}) is math_verify_reward


def test_resolve_refuses_what_is_not_allow_listed() -> None:
    with pytest.raises(ConfigError, match="not allow-listed"):
        resolve_reward_fn("os:system", ["rollstream.rewards:exact_match_reward"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:fn", "cannot import"),
        ("rollstream.rewards:nope", "cannot import"),
        ("rollstream.rewards.functions:log", "not callable"),
        ("justaname", "must look like"),
    ],
)
def test_resolve_errors_name_the_setting(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"reward.reward_fn.*{message}|{message}"):
        resolve_reward_fn(spec, [spec])

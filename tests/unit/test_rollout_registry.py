"""The workflow allow-list: config keys only, placeholders, clear errors."""

from __future__ import annotations

import pytest

from harness.fakes import EchoWorkflow, make_tokenizer
from rollstream.config import ConfigError, RolloutConfig, WorkflowSpec
from rollstream.rollout_workers.registry import UnknownWorkflowError, WorkflowRegistry
from rollstream.workflows.multi_turn import MultiTurnWorkflow
from rollstream.workflows.rlvr import RLVRWorkflow


def _registry(**rollout: object) -> WorkflowRegistry:
    return WorkflowRegistry.from_config(RolloutConfig(**rollout), make_tokenizer())  # type: ignore[arg-type]


def test_builtin_rlvr_is_the_default() -> None:
    reg = _registry(gconfig={"max_new_tokens": 8, "temperature": 0.5})
    wf = reg.resolve(None)
    assert isinstance(wf, RLVRWorkflow) and reg.resolve("rlvr") is wf
    assert wf.gconfig.max_new_tokens == 8 and wf.gconfig.temperature == 0.5
    tok = make_tokenizer()
    assert {tok.pad_token_id, tok.eos_token_id} <= set(wf.gconfig.stop_token_ids)
    assert wf.tokenizer is tok
    assert reg.keys() == ["rlvr"]


@pytest.mark.parametrize("key", ["nope", "harness.fakes.EchoWorkflow", "os.system", "harness.fakes:EchoWorkflow", ""])
def test_a_message_cannot_name_anything_outside_the_allow_list(key: str) -> None:
    reg = _registry(workflows={"echo": WorkflowSpec(path="harness.fakes.EchoWorkflow")})
    with pytest.raises(UnknownWorkflowError, match="not allowed") as err:
        reg.resolve(key)
    assert "echo" in str(err.value) and "rlvr" in str(err.value)


def test_configured_import_path_and_kwargs() -> None:
    reg = _registry(workflows={"echo": WorkflowSpec(path="harness.fakes:EchoWorkflow", kwargs={"reward": 0.25})})
    wf = reg.resolve("echo")
    assert isinstance(wf, EchoWorkflow) and wf.reward == 0.25


def test_multi_turn_with_reward_fn_import_string() -> None:
    spec = WorkflowSpec(
        path="multi_turn",
        kwargs={"reward_fn": "tests.unit.reward_fns.answer_in_completion", "max_turns": 2, "turn_discount": 0.5},
    )
    reg = _registry(workflows={"multi_turn": spec})
    wf = reg.resolve("multi_turn")
    assert isinstance(wf, MultiTurnWorkflow) and wf.max_turns == 2
    assert set(reg.keys()) == {"rlvr", "multi_turn"}


def test_placeholders_reach_custom_workflows() -> None:
    spec = WorkflowSpec(path="rollstream.workflows.rlvr.RLVRWorkflow", kwargs={"gconfig": "$gconfig", "tokenizer": "$tokenizer"})
    reg = _registry(workflows={"mine": spec}, gconfig={"max_new_tokens": 3})
    wf = reg.resolve("mine")
    assert isinstance(wf, RLVRWorkflow) and wf.gconfig.max_new_tokens == 3 and wf.tokenizer is make_tokenizer()


def test_unknown_default_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="rollout.default_workflow"):
        _registry(default_workflow="missing")


def test_bad_gconfig_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="rollout.gconfig"):
        _registry(gconfig={"max_new_tokenz": 3})


@pytest.mark.parametrize(
    "spec",
    [
        WorkflowSpec(path="no.such.module.Workflow"),
        WorkflowSpec(path="harness.fakes.not_a_workflow"),
        WorkflowSpec(path="multi_turn", kwargs={"max_turns": 2, "turn_discount": 0.5}),  # no reward_fn
        WorkflowSpec(path="multi_turn", kwargs={"reward_fn": "no.such.fn", "max_turns": 2, "turn_discount": 0.5}),
    ],
)
def test_unbuildable_entries_name_the_setting(spec: WorkflowSpec) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.workflows\.bad"):
        _registry(workflows={"bad": spec})

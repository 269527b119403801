"""One definition of a token's logprob: a training episode's request that would change it is
refused with the setting named (the sample fails, nothing else does); eval episodes sample freely."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollstream.api.io_struct import GenerationHyperparameters
from rollstream.api.engine import InvalidRequestError
from rollstream.engines.logprob_definition import check_trainable, shaping_settings
from rollstream.testing import check_workflow
from rollstream.testing.tiny import tiny_model_dir, workflow_gconfig, workflow_tokenizer
from rollstream.workflows.rlvr import RLVRWorkflow


def test_the_defaults_and_greedy_and_a_temperature_keep_the_definition() -> None:
    assert shaping_settings(GenerationHyperparameters()) == []
    assert shaping_settings(GenerationHyperparameters(temperature=0.6, greedy=True, top_k=-1, top_p=1.0)) == []
    assert shaping_settings(None) == []
    check_trainable(SimpleNamespace(top_p=1.0, top_k=0))  # AReaL's or another type, read by name


@pytest.mark.parametrize("setting, named", [
    ({"top_p": 0.9}, "top_p=0.9"), ({"top_k": 50}, "top_k=50"), ({"frequency_penalty": 0.2}, "frequency_penalty=0.2"),
    ({"min_new_tokens": 3}, "min_new_tokens=3"),
])
def test_each_setting_that_changes_a_logprob_is_refused_by_name(setting: dict, named: str) -> None:
    with pytest.raises(InvalidRequestError, match=named) as refused:
        check_trainable(GenerationHyperparameters(**setting))
    assert "log_softmax(logits / temperature)" in str(refused.value)


async def test_a_training_episode_with_top_p_fails_alone_and_an_eval_one_runs() -> None:
    """Through what the rollout worker runs (``check_workflow``: the episode engine, the tiny
    HF model): training samples fail with the reason, eval samples generate."""
    tokenizer = workflow_tokenizer(tiny_model_dir())
    workflow = RLVRWorkflow(workflow_gconfig(tokenizer, max_new_tokens=4, top_p=0.9), tokenizer)
    data = {"input_ids": [5, 6, 7]}
    training = await check_workflow(workflow, data, n=2, allow_failures=True)
    assert len(training.failed) == 2 and all("top_p=0.9" in (s.error or "") for s in training.failed)
    assert all(not s.responses for s in training.failed)  # refused before the engine generated
    evaluation = await check_workflow(workflow, data, n=2, is_eval=True)
    assert len(evaluation.episodes) == 2


def test_a_rollout_gconfig_that_changes_logprobs_is_named_at_start(caplog: pytest.LogCaptureFixture) -> None:
    """The worker says at start what every training sample would then fail on."""
    from harness.fakes import make_tokenizer
    from rollstream.config import RolloutConfig
    from rollstream.rollout_workers.registry import WorkflowRegistry

    WorkflowRegistry.from_config(RolloutConfig(gconfig={"top_p": 0.8, "max_new_tokens": 4}), make_tokenizer())
    assert any("rollout.gconfig sets top_p=0.8" in r.getMessage() for r in caplog.records)

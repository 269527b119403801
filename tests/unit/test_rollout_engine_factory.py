"""Engine and tokenizer settings: the right engine, and errors that name the setting."""

from __future__ import annotations

import re

import pytest

from harness.fakes import FakeEngine
from rollstream.config import ConfigError, RolloutConfig, config_from_dict
from rollstream.engines.hf import HFEngine
from rollstream.engines.sglang import SGLangEngine
from rollstream.rollout_workers.engine_factory import build_engine, load_tokenizer, tokenizer_path


def test_hf_engine_from_model_path() -> None:
    engine = build_engine(RolloutConfig(engine="hf", model_path="/models/tiny", device="cpu", seed=3))
    assert isinstance(engine, HFEngine)
    assert engine.model_path == "/models/tiny" and engine.seed == 3


def test_sglang_engine_from_urls() -> None:
    engine = build_engine(RolloutConfig(engine="sglang", server_urls=["http://127.0.0.1:1"], tokenizer_path="/tok"))
    assert isinstance(engine, SGLangEngine)


def make_fake_engine(config: RolloutConfig) -> FakeEngine:
    """A custom engine factory (named by import string in the tests below)."""
    engine = FakeEngine()
    engine.seed = config.seed  # type: ignore[attr-defined]
    return engine


def not_an_engine(config: RolloutConfig) -> object:
    return object()


def test_custom_engine_from_factory() -> None:
    engine = build_engine(RolloutConfig(
        engine="custom", engine_factory="tests.unit.test_rollout_engine_factory:make_fake_engine", seed=7,
    ))
    assert isinstance(engine, FakeEngine) and engine.seed == 7  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("config", "setting"),
    [
        (RolloutConfig(engine="custom"), "rollout.engine_factory must be set"),
        (RolloutConfig(engine="custom", engine_factory="no_such_module:make"), "cannot import"),
        (RolloutConfig(engine="custom", engine_factory="tests.unit.test_rollout_engine_factory:nothing"), "has no"),
        (RolloutConfig(engine="custom", engine_factory="tests.unit.test_rollout_engine_factory:not_an_engine"),
         "not an InferenceEngine"),
        (RolloutConfig(engine="hf"), "rollout.model_path"),
        (RolloutConfig(engine="sglang", tokenizer_path="/tok"), "rollout.server_urls"),
        (RolloutConfig(engine="sglang", server_urls=["http://x"]), "rollout.tokenizer_path"),
        (RolloutConfig(engine="hf", model_path="/m", weight_transfer="distributed"),
         "rollout.weight_transfer 'distributed' needs rollout.engine 'vllm'"),
        (RolloutConfig(engine="sglang", server_urls=["http://x"], weight_transfer="distributed"),
         "needs rollout.engine 'vllm'"),
    ],
)
def test_missing_settings_are_named(config: RolloutConfig, setting: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(setting)):
        build_engine(config)


def test_tokenizer_path_falls_back_to_model_path() -> None:
    assert tokenizer_path(RolloutConfig(model_path="/m")) == "/m"
    assert tokenizer_path(RolloutConfig(model_path="/m", tokenizer_path="/t")) == "/t"


def test_unloadable_tokenizer_is_a_config_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        load_tokenizer(RolloutConfig(model_path=str(tmp_path / "missing")))


@pytest.mark.parametrize(
    ("settings", "setting"),
    [({"commit_interval_seconds": 0}, "commit_interval_seconds"), ({"shutdown_grace_seconds": -1}, "shutdown_grace")],
)
def test_loop_settings_are_checked(settings: dict[str, float], setting: str) -> None:
    with pytest.raises(ConfigError, match=rf"\$\.rollout\.{setting}"):  # the schema names the key
        config_from_dict({"rollout": settings})

"""GenerationHyperparameters, ModelRequest and ModelResponse contracts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse


def test_defaults_follow_the_reference() -> None:
    g = GenerationHyperparameters()
    assert (g.n_samples, g.max_new_tokens, g.min_new_tokens, g.max_tokens) == (1, 16384, 0, 32768)
    assert (g.greedy, g.top_p, g.top_k, g.temperature) == (False, 1.0, int(1e8), 1.0)
    assert (g.stop_token_ids, g.ignore_eos, g.skip_special_tokens, g.stop, g.frequency_penalty) == (
        [], False, True, None, 0.0)


def test_new_copies_and_rejects_unknown_names() -> None:
    g = GenerationHyperparameters(stop_token_ids=[7])
    h = g.new(temperature=0.5)
    assert h.temperature == 0.5 and g.temperature == 1.0
    h.stop_token_ids.append(8)
    assert g.stop_token_ids == [7]  # lists are not shared between copies
    with pytest.raises(TypeError, match="unknown generation settings: \\['temprature'\\]"):
        g.new(temprature=0.5)


def test_stop_and_pad_ids_appended_pad_then_eos_once() -> None:
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    g = GenerationHyperparameters(stop_token_ids=[9]).new_with_stop_and_pad_token_ids(tok)
    assert g.stop_token_ids == [9, 0, 2]
    assert g.new_with_stop_and_pad_token_ids(tok).stop_token_ids == [9, 0, 2]
    assert GenerationHyperparameters(stop_token_ids=[2]).new_with_stop_and_pad_token_ids(tok).stop_token_ids == [2, 0]
    no_pad = SimpleNamespace(pad_token_id=None, eos_token_id=2)
    assert GenerationHyperparameters().new_with_stop_and_pad_token_ids(no_pad).stop_token_ids == [2]


@pytest.mark.parametrize(
    ("max_tokens", "max_new_tokens", "prompt_len", "budget"),
    [(100, 10, 50, 10), (100, 60, 50, 50), (100, 60, 99, 1)],
)
def test_budget_is_min_of_room_and_max_new(max_tokens: int, max_new_tokens: int, prompt_len: int, budget: int) -> None:
    g = GenerationHyperparameters(max_tokens=max_tokens, max_new_tokens=max_new_tokens)
    assert g.budget(prompt_len) == budget


@pytest.mark.parametrize("prompt_len", [100, 150])
def test_no_budget_is_an_error(prompt_len: int) -> None:
    with pytest.raises(ValueError, match=f"prompt has {prompt_len} tokens, max_tokens=100"):
        GenerationHyperparameters(max_tokens=100).budget(prompt_len)
    with pytest.raises(ValueError, match="no generation budget"):
        GenerationHyperparameters(max_new_tokens=0).budget(1)


def test_request_copy_is_independent_and_rids_unique() -> None:
    req = ModelRequest(input_ids=[1, 2], metadata={"k": 1}, image_data=["img"])
    dup = req.copy()
    dup.input_ids.append(3)
    dup.metadata["k"] = 2
    dup.gconfig.stop_token_ids.append(5)
    dup.image_data.append("other")  # type: ignore[union-attr]
    assert req.input_ids == [1, 2] and req.metadata == {"k": 1} and req.gconfig.stop_token_ids == []
    assert req.image_data == ["img"]
    assert dup.rid == req.rid and ModelRequest().rid != ModelRequest().rid


def test_response_lengths() -> None:
    resp = ModelResponse(input_tokens=[1, 2, 3], output_tokens=[4], output_logprobs=[-0.1], output_versions=[0])
    assert (resp.input_len, resp.output_len, resp.stop_reason) == (3, 1, "stop")


def test_new_does_not_share_a_given_stop_list() -> None:
    stops = [1]
    g = GenerationHyperparameters().new(stop_token_ids=stops)
    stops.append(2)
    assert g.stop_token_ids == [1]

"""The vLLM server kind's pure pieces: sampling settings, answers, version labels."""

from __future__ import annotations

import json
import math

import pytest

from rollstream.api.io_struct import GenerationHyperparameters
from rollstream.config import ConfigError, load_config
from rollstream.engines.server_http import (
    EngineRequestError,
    WeightLabel,
    loading_label,
    parse_label,
    weight_label,
)
from rollstream.engines.server_pool import Server, stale_labels
from rollstream.engines.vllm import parse_tokens_answer, vllm_sampling_params


def answer(tokens: list[int], spans: list[dict] | None, finish: str = "length", logprobs: list | None = None) -> dict:
    lps = logprobs if logprobs is not None else [-0.5] * len(tokens)
    return {"choices": [{"index": 0, "finish_reason": finish, "token_ids": tokens, "weight_versions": spans,
                         "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(tokens, lps)]}}]}


def test_sampling_settings_map_onto_vllm_names() -> None:
    g = GenerationHyperparameters(max_new_tokens=10, min_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20,
                                  stop_token_ids=[0, 2], frequency_penalty=0.1)
    params = vllm_sampling_params(g, remaining=7, generated=3)
    assert params == {"max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_tokens": 1,
                      "stop_token_ids": [0, 2], "ignore_eos": False, "frequency_penalty": 0.1, "logprobs": 0,
                      "detokenize": False, "skip_special_tokens": True}


def test_off_settings_and_greedy_and_stop_strings() -> None:
    params = vllm_sampling_params(GenerationHyperparameters(greedy=True, stop=["\n"]), remaining=5, generated=0)
    assert params["temperature"] == 0.0 and params["top_k"] == 0 and params["min_tokens"] == 0
    assert params["stop"] == ["\n"] and params["detokenize"] is True  # stop strings need text


def test_each_token_takes_the_version_of_its_span() -> None:
    span = parse_tokens_answer(answer([5, 6, 7], [{"version": "default", "start": 0, "end": 1},
                                                  {"version": "3", "start": 1, "end": 3}]))
    assert span.tokens == [5, 6, 7] and span.versions == [0, 3, 3] and span.reported == 3
    assert span.finish == {"type": "length"} and span.older_than(1) and not span.older_than(0)


def test_an_empty_abort_reports_no_version() -> None:
    span = parse_tokens_answer(answer([], None, finish="abort"))
    assert span.tokens == [] and span.versions == [] and span.reported is None and not span.older_than(5)


def test_tokens_made_during_a_load_make_the_answer_unlabelled() -> None:
    span = parse_tokens_answer(answer([5, 6], [{"version": "3", "start": 0, "end": 1},
                                               {"version": loading_label(4, 9), "start": 1, "end": 2}]))
    assert span.unlabelled and span.versions == [] and span.reported is None


@pytest.mark.parametrize("spans, why", [
    (None, "without weight_versions"),  # an older vLLM
    ([{"version": "mine", "start": 0, "end": 2}], "not a rollstream version"),
    ([{"version": "1", "start": 0, "end": 1}], "cover 1 of 2"),
    ([{"version": "1", "start": 1, "end": 2}], "do not tile"),
])
def test_unusable_labels_are_refused(spans: list | None, why: str) -> None:
    with pytest.raises(EngineRequestError, match=why):
        parse_tokens_answer(answer([5, 6], spans))


def test_a_non_finite_logprob_is_none() -> None:
    span = parse_tokens_answer(answer([5, 6], [{"version": "1", "start": 0, "end": 2}], logprobs=[math.nan, -1.0]))
    assert span.logprobs == [None, -1.0]


def test_vllms_floor_for_nan_and_minus_infinity_is_no_logprob() -> None:
    # what vLLM 0.32's token-in/token-out serving sends for a NaN or -inf logprob: -9999.0 in JSON
    raw = json.dumps(answer([5, 6, 7], [{"version": "1@3", "start": 0, "end": 3}], logprobs=[-9999.0, -2.5, -9999.0]))
    span = parse_tokens_answer(json.loads(raw))
    assert span.logprobs == [None, -2.5, None]


def test_labels_name_the_version_and_the_epoch_that_wrote_them() -> None:
    assert parse_label(weight_label(7, 123)) == WeightLabel(7, 123, False)
    assert parse_label(loading_label(7, 123)) == WeightLabel(None, 123, True)
    assert parse_label("default") == WeightLabel(0, 0, False)
    assert parse_label("7") == WeightLabel(7, 0, False)  # no epoch: never taken for a stale one
    assert parse_label("mine").version is None and parse_label(None).version is None
    assert parse_label(loading_label(7, 1)).version is None and parse_label("7@1").version == 7


def test_a_label_a_former_owner_wrote_after_its_successor_is_stale() -> None:
    span = parse_tokens_answer(answer([5, 6, 7], [{"version": weight_label(2, 100), "start": 0, "end": 1},
                                                  {"version": weight_label(3, 200), "start": 1, "end": 3}]))
    assert span.epochs == [100, 200]
    assert not stale_labels(span.epochs, known=100)  # frozen across an owner change (keep): both true
    assert stale_labels(span.epochs, known=200)  # the server had accepted 200 before the request was sent
    assert stale_labels([200, 100], known=0)  # a former owner's label after its successor's, in one answer
    assert not stale_labels([0, 100], known=100)  # the launch weights carry no epoch
    server = Server("http://s")
    server.observe(parse_label(weight_label(3, 200)))
    assert (server.version, server.epoch) == (3, 200)
    server.observe(parse_label(weight_label(2, 100)))  # a former owner's label read from the server
    assert server.version is None and server.epoch == 200
    server.observe(parse_label("default"))  # a restarted server: its launch weights are version 0
    assert server.version == 0


def test_moved_server_keys_name_their_new_place() -> None:
    with pytest.raises(ConfigError, match="rollout.server_urls"):
        load_config(environ={"ROLLSTREAM__ROLLOUT__SGLANG_URLS": '["http://x:1"]'})
    with pytest.raises(ConfigError, match="rollout.server"):
        load_config(overrides=["rollout.sglang.max_retries=2"], environ={})
    config = load_config(overrides=["rollout.engine=vllm", 'rollout.server_urls=["http://x:1"]'], environ={})
    assert config.rollout.engine == "vllm" and config.rollout.server_urls == ["http://x:1"]

"""The agent endpoint's pure parts: tool-call parsing, message keys, prompt continuation,
generation settings, and how turns become rows with their rewards."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollstream.agent.chat_template import ChatRenderer
from rollstream.agent.completions import generation_settings
from rollstream.agent.conversation import Conversation, Turn
from rollstream.agent.messages import RequestError, clean_messages, message_key
from rollstream.agent.openai_types import decode_request
from rollstream.agent.tool_calls import parse_tool_calls
from rollstream.api.io_struct import GenerationHyperparameters, ModelResponse
from rollstream.trajectory.rows import validate_trajectory

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>'


def test_tool_calls_are_cut_out_of_the_content() -> None:
    content, calls = parse_tool_calls(f"Let me compute.\n{CALL}", {"calculator"})
    assert content == "Let me compute."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("calculator", {"expression": "3+4"})]
    assert parse_tool_calls(CALL + CALL, {"calculator"})[0] is None


@pytest.mark.parametrize("text", [
    CALL.replace("calculator", "search"),  # not one of the request's tools
    CALL.replace("}}", "}"),  # malformed JSON
    CALL[:-len("</tool_call>")],  # cut off by the token budget
    "7",
])
def test_what_is_not_a_complete_known_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text, {"calculator"}) == (text, [])


def test_messages_are_cleaned_for_the_template_and_bad_ones_named() -> None:
    cleaned = clean_messages([
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ])
    assert cleaned[0] == {"role": "system", "content": "be brief"}
    assert "content" not in cleaned[1] and "refusal" not in cleaned[1]
    assert cleaned[1]["tool_calls"][0]["function"]["arguments"] == {"expression": "1+1"}  # what templates render
    for bad, where in [([], "messages"), ([{"role": "robot", "content": "x"}], "messages[0].role"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content")]:
        with pytest.raises(RequestError) as info:
            clean_messages(bad)
        assert info.value.param == where


def test_message_keys_compare_json_arguments_as_values() -> None:
    sent = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]}
    back = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "other-id", "function": {"name": "f", "arguments": {"a": 2, "b": 1}}}]}
    assert message_key(sent) == message_key(back)
    assert message_key(sent) != message_key({**back, "content": "text"})


def test_unsupported_request_fields_are_refused_by_name() -> None:
    assert decode_request(b'{"messages": [], "seed": 3, "user": "u"}').seed == 3  # accepted, no effect
    for body, named in [(b'{"messages": [], "presence_penalty": 1}', "presence_penalty"),
                        (b'{"messages": [], "top_logprobs": 5}', "top_logprobs"),
                        (b'{"messages": [], "n": 0}', r"\$\.n"),
                        (b'{"messages": [], "response_format": {"type": "json_object"}}', "response_format"),
                        (b'{"messages": [], "best_of": 2}', "best_of")]:
        with pytest.raises(RequestError, match=named):
            decode_request(body)


def test_request_settings_override_the_workers() -> None:
    defaults = GenerationHyperparameters(max_new_tokens=100, temperature=0.7, stop_token_ids=[0])
    request = decode_request(b'{"messages": [], "max_tokens": 30, "max_completion_tokens": 20, '
                             b'"temperature": 0, "top_p": 0.5, "stop": "\\n\\n", "frequency_penalty": 0.1}')
    g = generation_settings(defaults, request, turn_end_ids=[2])
    assert (g.max_new_tokens, g.greedy, g.temperature, g.top_p, g.stop, g.frequency_penalty) == (20, True, 0, 0.5, ["\n\n"], 0.1)
    assert g.stop_token_ids == [0, 2]
    plain = generation_settings(defaults, decode_request(b'{"messages": []}'), [2])
    assert (plain.max_new_tokens, plain.temperature, plain.greedy) == (100, 0.7, False)


def test_a_continuation_closes_the_turn_the_model_did_not_close(tiny_tokenizer: Any) -> None:
    renderer = ChatRenderer(tiny_tokenizer)
    question = [{"role": "user", "content": "3+4="}]
    history = [*question, {"role": "assistant", "content": "7"}]
    new = [{"role": "user", "content": "sure?"}]
    full = renderer.render([*history, *new], generation_prompt=True)
    closed = renderer.encode("7") + renderer.turn_end_ids  # stopped on <|im_end|>
    cut = renderer.encode("7")  # cut off by the budget
    for output in (closed, cut):
        ids = renderer.prompt_ids(question) + output + (renderer.continuation_ids(history, new, output) or [])
        assert tiny_tokenizer.decode(ids) == full, "the same text as the template, from the model's own tokens"
    assert renderer.turn_end_ids == tiny_tokenizer.convert_tokens_to_ids(["<|im_end|>"])


def _turn(cid: str, prompt: list[int], out: list[int], parent: Turn | None = None, version: int = 0) -> Turn:
    start = parent.full_ids if parent is not None else []
    resp = ModelResponse(input_tokens=start + prompt, output_tokens=out, output_logprobs=[-0.5] * len(out),
                         output_versions=[version] * len(out))
    return Turn(completion_id=cid, choice=0, new_prompt=prompt, response=resp, parent=parent)


def test_rows_are_the_leaves_with_the_discounted_return_of_their_chain() -> None:
    conversation = Conversation()
    first = _turn("a", [1, 2], [3])
    conversation.add(first)
    second = _turn("b", [4], [5, 6], parent=first, version=1)
    conversation.add(second)
    alone = _turn("c", [9], [8])
    conversation.add(alone)
    conversation.set_reward(0.5, "a")
    conversation.set_reward(1.0, "b")
    td = conversation.export(turn_discount=0.9)
    validate_trajectory(td)
    assert td["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6], [9, 8, 0, 0, 0, 0]]
    assert td["loss_mask"].tolist() == [[0, 0, 1, 0, 1, 1], [0, 1, 0, 0, 0, 0]]
    assert td["versions"].tolist() == [[-1, -1, 0, -1, 1, 1], [-1, 0, -1, -1, -1, -1]]
    assert td["rewards"].tolist() == pytest.approx([0.5 + 0.9 * 1.0, 0.0])


def test_without_any_reward_rows_are_left_to_the_reward_tier() -> None:
    conversation = Conversation()
    conversation.add(_turn("a", [1], [2]))
    assert "rewards" not in conversation.export()
    with pytest.raises(KeyError, match="nope"):
        conversation.set_reward(1.0, "nope")
    with pytest.raises(LookupError):
        Conversation().set_reward(1.0)

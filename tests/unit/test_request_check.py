"""accepted_request / checked_input_ids: what a request may carry, and the cause each refusal names."""

from __future__ import annotations

from types import SimpleNamespace

import numpy
import pytest
import torch

from harness.fakes import make_tokenizer
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest
from rollstream.api.engine import InvalidRequestError
from rollstream.engines.request_check import accepted_request, checked_input_ids
from rollstream.testing import ScriptedEngine


MESSAGES = [{"role": "user", "content": "what is two plus three"}]


@pytest.mark.parametrize(
    "ids", [[1, 2, 3], (1, 2, 3), numpy.array([1, 2, 3]), torch.tensor([1, 2, 3]), [numpy.int64(1), torch.tensor(2), 3]]
)
def test_flat_integer_sequences_are_accepted(ids: object) -> None:
    assert checked_input_ids(ids, vocab_size=4, max_context=8) == [1, 2, 3]


def test_what_transformers_returns_is_accepted() -> None:
    tok = make_tokenizer()
    chat = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=False)
    text = tok.encode("what is two plus three")
    forms = [
        (tok.apply_chat_template(MESSAGES, tokenize=True), chat),  # a BatchEncoding (transformers 5)
        (tok.apply_chat_template(MESSAGES, tokenize=True, return_tensors="pt"), chat),  # holding [1, L]
        (tok.apply_chat_template(MESSAGES, tokenize=True, return_tensors="pt")["input_ids"], chat),
        (tok.apply_chat_template(MESSAGES, tokenize=True, return_tensors="np")["input_ids"], chat),
        (tok.apply_chat_template([MESSAGES], tokenize=True, return_dict=False), chat),  # a batch of one
        (tok("what is two plus three"), text),
        (tok(["what is two plus three"], return_tensors="pt"), text),
    ]
    for ids, expected in forms:
        assert checked_input_ids(ids) == expected, type(ids)


def test_the_keys_of_a_batch_encoding_name_the_cause_and_the_fix() -> None:
    encoding = make_tokenizer().apply_chat_template(MESSAGES, tokenize=True)
    with pytest.raises(InvalidRequestError, match=r"input_ids is \['input_ids', 'attention_mask'\], not token ids: "
                       r"list\(\) of a BatchEncoding .* is its keys; pass the BatchEncoding itself, its \['input_ids'\], "
                       r"or call apply_chat_template\(\.\.\., return_dict=False\)"):
        checked_input_ids(list(encoding))


@pytest.mark.parametrize(
    ("ids", "needle"),
    [
        ([], "empty"),
        ("what is two", "text, not token ids"),
        ([1, "two"], "input_ids[1] is the string 'two'"),
        ([[1, 2], [3]], "nested: 2 prompts (a batch?)"),
        (torch.tensor([[1, 2], [3, 4]]), "shape [2, 2]: 2 prompts"),
        (torch.zeros((1, 1, 2), dtype=torch.long), "shape [1, 1, 2]"),
        ([1, [2]], "input_ids[1] is a sequence"),
        ([1.0, 2.0], "input_ids[0] is 1.0 (float)"),
        ([True, False], "bool (an attention mask?)"),
        ({"ids": [1]}, "dict with keys ['ids'] and no 'input_ids'"),
        (42, "input_ids is a int"),
        ([1, 100000], "input_ids[1] = 100000 is outside the model's vocabulary (ids 0..9)"),
        ([-1], "input_ids[0] = -1 is outside"),
        (list(range(8)), "the prompt has 8 tokens but the model's context holds 8"),
    ],
)
def test_malformed_requests_are_refused_with_their_cause(ids: object, needle: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        checked_input_ids(ids, vocab_size=10, max_context=8)
    assert needle in str(info.value), str(info.value)


async def test_the_reference_guides_line_is_refused_naming_the_fix(tiny_tokenizer: object) -> None:
    """The guide's template builds ``ModelRequest(input_ids=list(apply_chat_template(..., tokenize=True)))``:
    in transformers 5 that is the encoding's keys; the engine says so instead of failing later."""
    input_ids = tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)  # type: ignore[attr-defined]
    engine = ScriptedEngine([[5]], vocab_size=len(tiny_tokenizer))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=r"pass the BatchEncoding itself, its \['input_ids'\], or call "
                                                  r"apply_chat_template\(\.\.\., return_dict=False\)"):
        await engine.agenerate(ModelRequest(input_ids=list(input_ids)))
    resp = await engine.agenerate(ModelRequest(input_ids=input_ids))  # the encoding itself is taken
    assert resp.input_tokens == list(input_ids["input_ids"])  # type: ignore[index]


def test_foreign_settings_become_rollstreams_and_what_cannot_be_honoured_is_refused() -> None:
    class Settings:  # another project's settings type with the same names (AReaL's has two more)
        def __init__(self, **kw: object) -> None:
            self.__dict__.update(GenerationHyperparameters().__dict__ | {"lora_name": "default_lora",
                                                                        "use_beam_search": False} | kw)

    request = accepted_request(SimpleNamespace(input_ids=[1, 2], gconfig=Settings(max_new_tokens=3, stop_token_ids=[None, 2])))
    assert type(request.gconfig) is GenerationHyperparameters and request.gconfig.max_new_tokens == 3
    assert request.gconfig.stop_token_ids == [2] and request.input_ids == [1, 2] and request.rid
    with pytest.raises(InvalidRequestError, match="n_samples is 2"):
        accepted_request(ModelRequest(input_ids=[1], gconfig=GenerationHyperparameters(n_samples=2)))
    with pytest.raises(InvalidRequestError, match="beam search"):
        accepted_request(SimpleNamespace(input_ids=[1], gconfig=Settings(use_beam_search=True)))
    with pytest.raises(InvalidRequestError, match="SimpleNamespace without \\['min_new_tokens', 'max_tokens'"):
        accepted_request(SimpleNamespace(input_ids=[1], gconfig=SimpleNamespace(n_samples=1, max_new_tokens=3)))
    with pytest.raises(InvalidRequestError, match="must be a ModelRequest"):
        accepted_request([1, 2])

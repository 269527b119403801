"""checked_input_ids: what a request may carry, and the cause each refusal names."""

from __future__ import annotations

import numpy
import pytest
import torch

from rollstream.api.request_check import InvalidRequestError, checked_input_ids
from tests.unit.fakes import make_tokenizer

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

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


def test_a_batch_encoding_names_transformers_5_and_the_fix() -> None:
    encoding = make_tokenizer().apply_chat_template(MESSAGES, tokenize=True, return_dict=True)
    for ids in (encoding, list(encoding)):  # as returned, and what list() of it gives
        with pytest.raises(InvalidRequestError, match=r"BatchEncoding in transformers 5; pass return_dict=False, or take \['input_ids'\]"):
            checked_input_ids(ids)


@pytest.mark.parametrize(
    ("ids", "needle"),
    [
        ([], "empty"),
        ("what is two", "text, not token ids"),
        ([1, "two"], "input_ids[1] is the string 'two'"),
        ([[1, 2], [3]], "nested (a batch of prompts?)"),
        (torch.tensor([[1, 2]]), "shape [1, 2]"),
        ([1.0, 2.0], "input_ids[0] is 1.0 (float)"),
        ([True, False], "bool (an attention mask?)"),
        ({"ids": [1]}, "dict with keys ['ids']"),
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

"""The tokenizer workflows receive returns token ids from apply_chat_template, as workflows
written for transformers 4 expect, and still pickles."""

from __future__ import annotations

import copy
import pickle

from rollstream.tokenizer_compat import ids_from_chat_template
from tests.unit.fakes import ids, make_tokenizer

MESSAGES = [{"role": "user", "content": "what is two plus three"}]


def test_apply_chat_template_returns_ids_unless_asked_for_a_dict() -> None:
    plain = copy.deepcopy(make_tokenizer())
    assert not isinstance(plain.apply_chat_template(MESSAGES, tokenize=True), list)  # transformers 5
    tok = ids_from_chat_template(copy.deepcopy(make_tokenizer()))
    expected = ids("<|user|> what is two plus three <|assistant|>")
    assert tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True) == expected
    assert tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"] == expected
    assert isinstance(tok.apply_chat_template(MESSAGES, tokenize=False), str)
    assert ids_from_chat_template(tok) is tok


def test_wrapped_tokenizer_pickles_and_copies() -> None:
    tok = ids_from_chat_template(copy.deepcopy(make_tokenizer()))
    for clone in (pickle.loads(pickle.dumps(tok)), copy.deepcopy(tok)):
        assert clone.apply_chat_template(MESSAGES, tokenize=True) == tok.apply_chat_template(MESSAGES, tokenize=True)

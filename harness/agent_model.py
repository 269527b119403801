"""A tiny model taught one tool-calling conversation, for tests of the agent endpoint.

A random tiny model never writes a ``<tool_call>`` block, so :func:`tool_model` fine-tunes a
tiny model (:func:`agent_base_model`: its tokenizer knows these texts, so prompts are short;
a few seconds on CPU) until greedy decoding answers
``"3+4="`` with a calculator call and, after the tool's ``"7"``, with ``"7"``. The prompts it
learns are made exactly as the endpoint makes them (``ChatRenderer``), so the endpoint's
greedy answers are that conversation.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from examples.agent_calculator import CALCULATOR

from rollstream.agent.chat_template import ChatRenderer
from rollstream.demo.agent import AGENT_VOCAB, agent_corpus
from rollstream.tiny.text_model import build_tiny_model


QUESTION = [{"role": "user", "content": "3+4="}]
TOOL_CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>'
TOOLS = [CALCULATOR]
MAX_STEPS = 400


def conversation_ids(tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """``(prompt, completion)`` token ids of the two turns, as the endpoint builds them."""
    renderer = ChatRenderer(tokenizer)
    first_prompt = renderer.prompt_ids(QUESTION, TOOLS)
    first = renderer.encode(TOOL_CALL_TEXT) + renderer.turn_end_ids
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "3+4"}}}]}
    tail = renderer.continuation_ids([*QUESTION, call], [{"role": "tool", "content": "7"}], first, TOOLS)
    assert tail is not None
    second_prompt = first_prompt + first + tail
    return [(first_prompt, first), (second_prompt, renderer.encode("7") + renderer.turn_end_ids)]


def _greedy(model: Any, prompt: list[int], length: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=length, do_sample=False)
    return out[0, len(prompt):].tolist()


def agent_base_model(out: Path) -> Path:
    """A tiny random model whose tokenizer knows the agent demo's texts (short prompts)."""
    return build_tiny_model(out, agent_corpus(TOOLS), vocab_size=AGENT_VOCAB)


def tool_model(base: Path, out: Path) -> Path:
    """``base`` fine-tuned on the conversation (see the module docstring), saved in ``out``."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    pairs = conversation_ids(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(MAX_STEPS):
            model.train()
            for prompt, completion in pairs:
                ids = torch.tensor([prompt + completion])
                logits = model(ids).logits[0, len(prompt) - 1:-1]
                loss = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(completion))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            model.eval()
            if step % 20 == 19 and all(_greedy(model, p, len(c)) == c for p, c in pairs):
                break
        else:
            raise AssertionError("the tiny model did not learn the tool-calling conversation")
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def perturbed_copy(base: Path, out: Path, seed: int, scale: float = 0.02) -> Path:
    """``base`` with every weight moved by Gaussian noise: another version's distinct weights."""
    model = AutoModelForCausalLM.from_pretrained(base)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out

"""``rollstream demo --agent``: the demo's sums answered through the example agent.

The rollout workers run ``examples/agent_calculator.py`` (the plain ``openai`` client, a
calculator tool) against their agent endpoint instead of the RLVR workflow; the agent scores
its own answer. What changes beside the config:

* the model: its tokenizer is also trained on the chat texts of these conversations (the
  tools prompt and tool calls become a few tokens each), and the warm-up teaches the FORMAT
  of both turns, not the answers: half the time a calculator call on the question, else a
  random digit; after a tool result, a random digit (never the result). Copy tasks in chat
  form ("3|4=" -> "4", as in the plain demo) give the model features for reading digits.
  Learning to call the tool and to answer with its result is left to reinforcement learning.
* the rollout workers import ``examples`` (it is not installed): its checkout is put on their
  ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from rollstream.demo.model import PreparedModel, WARMUP_BATCH, warm_up
from rollstream.demo.task import problems, prompt_text, tokenizer_corpus
from rollstream.tiny_model import CHAT_TEMPLATE, build_tiny_model

log = logging.getLogger(__name__)

AGENT_MODULE = "examples.agent_calculator"
AGENT_KEY = "calculator_agent"
AGENT_MAX_TURNS = 3
AGENT_MAX_TOKENS = 40  # a calculator call is 30 tokens with the agent tokenizer
AGENT_VOCAB = 512  # more than the corpus fills: every merge is learnt
WARMUP_MIX = (("call", 0.45), ("digit", 0.15), ("after_tool", 0.25), ("copy", 0.15))


def examples_parent() -> Path:
    """The directory whose ``examples/`` holds the example agent (the current directory or the
    checkout this package runs from); ``ImportError`` saying where it looked otherwise."""
    roots = [Path.cwd(), Path(__file__).resolve().parents[2]]
    for root in roots:
        if (root / "examples" / "agent_calculator.py").is_file():
            return root
    raise ImportError(
        "cannot find examples/agent_calculator.py (looked in " + ", ".join(map(str, roots))
        + "): run from the repository root"
    )


def load_example_agent() -> ModuleType:
    """``examples.agent_calculator``, importable from :func:`examples_parent`."""
    root = str(examples_parent())
    import sys

    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(AGENT_MODULE)


def child_env() -> dict[str, str]:
    """Environment for tier processes: ``examples`` importable."""
    path = [str(examples_parent()), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}


def with_agent(tree: dict[str, Any]) -> dict[str, Any]:
    """The demo config tree with the example agent as the rollout workers' workflow."""
    rollout = dict(tree["rollout"])
    rollout["workflows"] = {AGENT_KEY: {"path": f"{AGENT_MODULE}:CalculatorAgent", "kwargs": {
        "max_turns": AGENT_MAX_TURNS, "max_tokens": AGENT_MAX_TOKENS,
        "temperature": rollout.get("gconfig", {}).get("temperature", 1.0),
    }}}
    rollout["default_workflow"] = AGENT_KEY
    rollout["agent"] = {"timeout_seconds": 120.0}
    return {**tree, "rollout": rollout}


# ---- the model -------------------------------------------------------------------------------


def _render(messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation_prompt: bool) -> str:
    """The tiny chat template's text, rendered without a tokenizer (only to train one)."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, tools=tools, add_generation_prompt=generation_prompt)


def _call(a: int, b: int) -> dict[str, Any]:
    arguments = json.dumps({"expression": f"{a}+{b}"})
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calculator", "arguments": arguments}}]}


def agent_corpus(tools: list[dict[str, Any]]) -> list[str]:
    """The tokenizer corpus: the plain demo's, plus every conversation of the agent task."""
    texts = []
    for a, b in problems():
        question = {"role": "user", "content": prompt_text(a, b)}
        conversation = [question, _call(a, b), {"role": "tool", "content": str(a + b)},
                        {"role": "assistant", "content": str(a + b)}]
        texts.append(_render(conversation, tools, generation_prompt=False))
    return tokenizer_corpus() + texts


def agent_warmup_pairs(tokenizer: Any, tools: list[dict[str, Any]], count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``(prompt text, completion text)`` pairs of the agent warm-up (see the module doc)."""
    rng = random.Random(seed)
    kinds, weights = zip(*WARMUP_MIX)
    end = "<|im_end|>"
    pairs = []
    for _ in range(count):
        a, b = rng.choice(problems())
        question = [{"role": "user", "content": prompt_text(a, b)}]
        kind = rng.choices(kinds, weights)[0]
        if kind == "copy":
            op, answer = rng.choice((("&", a), ("|", b)))
            copy = [{"role": "user", "content": f"{a}{op}{b}="}]
            pairs.append((tokenizer.apply_chat_template(copy, tokenize=False, add_generation_prompt=True), f"{answer}{end}"))
            continue
        if kind == "after_tool":
            question = [*question, _call(a, b), {"role": "tool", "content": str(a + b)}]
        prompt = tokenizer.apply_chat_template(question, tools=tools, tokenize=False, add_generation_prompt=True)
        completion = _render([_call(a, b)], [], False) if kind == "call" else f"{rng.randrange(10)}{end}"
        if kind == "call":  # the assistant turn's text after its header, up to and with <|im_end|>
            completion = completion.split("\n", 1)[1].rstrip("\n")
        pairs.append((prompt, completion))
    return pairs


def prepare_agent_model(out_dir: Path, *, warmup_steps: int, hidden_size: int = 64, num_layers: int = 2,
                        seed: int = 0) -> PreparedModel:
    """Build the agent demo's tiny model and tokenizer, warm it up, save it in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tools = [load_example_agent().CALCULATOR]
    base = build_tiny_model(out_dir.parent / "agent-base-model", agent_corpus(tools), vocab_size=AGENT_VOCAB,
                            hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base)
        pairs = agent_warmup_pairs(tokenizer, tools, warmup_steps * WARMUP_BATCH, seed=seed)
        loss = warm_up(model, tokenizer, pairs, warmup_steps)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    log.info("warmed-up agent model (loss %.3f) saved in %s", loss, out_dir)
    return PreparedModel(out_dir, loss, sum(p.numel() for p in model.parameters()))


def token_lengths(tokenizer: Any, pairs: Sequence[tuple[str, str]]) -> tuple[int, int]:
    """Longest prompt and completion of ``pairs`` in tokens (to size the generation budget)."""
    return (max(len(tokenizer.encode(p)) for p, _ in pairs), max(len(tokenizer.encode(c)) for _, c in pairs))

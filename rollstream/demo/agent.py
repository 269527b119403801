"""``rollstream demo --agent``: the demo's sums answered through the example agent.

The rollout workers run ``examples/agent_calculator.py`` (the plain ``openai`` client, a
calculator tool) against their agent endpoint instead of the RLVR workflow; the agent scores
its own answer. What changes beside the config:

* the model: its tokenizer is also trained on the chat texts of these conversations (and
  has ``<tool_call>`` / ``</tool_call>`` as single tokens, as Qwen's have), and the warm-up
  teaches FORMAT, not answers, in two phases. Reading (short chat texts, cheap): the plain
  demo's warm-up as chat turns ("3&4=" -> "3", "3|4=" -> "4", "3+4=" -> a random digit).
  Format (the long prompts with the tools): a calculator call on the question, or a random
  digit; after the tool's result, a random digit, never the result; some reading turns.
  Whether to call the tool, and what to answer after its result, is left to reinforcement
  learning (what it learnt in the measured runs: docs/WORKFLOWS.md, "Write an agent workflow").
  DECISION: the call the warm-up teaches carries no expression (the calculator then
  evaluates the question): copying the operands ~25 tokens back into one is beyond what the
  150k-parameter model learns in minutes on a CPU (tried: no progress in 500 warm-up steps,
  also at hidden size 128).
* the rollout workers import ``examples`` (it is not installed): its checkout is put on their
  ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import random
from pathlib import Path
from types import ModuleType
from typing import Any

from rollstream.demo.example_trainer import examples_parent
from rollstream.demo.model import PreparedModel, WARMUP_BATCH, save_prepared, warm_up
from rollstream.demo.task import problems, prompt_text, tokenizer_corpus, warmup_texts
from rollstream.tiny.text_model import CHAT_TEMPLATE, build_tiny_model

log = logging.getLogger(__name__)

AGENT_MODULE = "examples.agent_calculator"
AGENT_SCRIPT = Path("examples") / "agent_calculator.py"
AGENT_KEY = "calculator_agent"
AGENT_MAX_TURNS = 3
AGENT_MAX_TOKENS = 40  # a calculator call is about 20 tokens with the agent tokenizer
AGENT_VOCAB = 512  # more than the corpus fills: every merge is learnt
FORMAT_STEPS_SHARE = 2  # format warm-up steps = warmup_steps / this
FORMAT_BATCH = 32
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")
# The call the warm-up teaches: the shortest valid one (no "arguments": the calculator then
# evaluates the question), so that sampling at temperature 1 rarely breaks it.
CALL_TEXT = '<tool_call>\n{"name": "calculator"}\n</tool_call>'

FORMAT_MIX = (("call", 0.4), ("digit", 0.15), ("after_tool", 0.3), ("read", 0.15))


def load_example_agent() -> ModuleType:
    """``examples/agent_calculator.py``, loaded from its file (the demo process only reads its tool
    schema; ``sys.path`` is left as it is)."""
    path = examples_parent(AGENT_SCRIPT, ImportError) / AGENT_SCRIPT
    spec = importlib.util.spec_from_file_location("rollstream_demo_example_agent", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child_env() -> dict[str, str]:
    """Environment for tier processes: ``examples`` importable."""
    root = examples_parent(AGENT_SCRIPT, ImportError)
    path = [str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
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


def _call() -> dict[str, Any]:
    """The assistant turn calling the calculator on the question (no expression)."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]}


def agent_corpus(tools: list[dict[str, Any]]) -> list[str]:
    """The tokenizer corpus: the plain demo's, plus every conversation of the agent task."""
    texts = []
    for a, b in problems():
        conversation = [{"role": "user", "content": prompt_text(a, b)}, _call(), {"role": "tool", "content": str(a + b)},
                        {"role": "assistant", "content": str(a + b)}]
        texts.append(_render(conversation, tools, generation_prompt=False))
    return tokenizer_corpus() + texts


def _chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


END = "<|im_end|>"


def reading_pairs(tokenizer: Any, count: int, seed: int = 0) -> list[tuple[str, str]]:
    """The plain demo's warm-up pairs (``warmup_texts``) as chat turns without tools."""
    return [(_chat(tokenizer, [{"role": "user", "content": p}]), f"{c}{END}") for p, c in warmup_texts(count, seed)]


def format_pairs(tokenizer: Any, tools: list[dict[str, Any]], count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``(prompt text, completion text)`` of the format warm-up (see the module docstring)."""
    rng = random.Random(seed)
    kinds, weights = zip(*FORMAT_MIX)
    call_text = CALL_TEXT + END
    pairs = []
    for _ in range(count):
        a, b = rng.choice(problems())
        question = [{"role": "user", "content": prompt_text(a, b)}]
        kind = rng.choices(kinds, weights)[0]
        if kind == "read":
            pairs.extend(reading_pairs(tokenizer, 1, rng.randrange(1 << 30)))
        elif kind == "call":
            pairs.append((_chat(tokenizer, question, tools), call_text))
        elif kind == "digit":
            pairs.append((_chat(tokenizer, question, tools), f"{rng.randrange(10)}{END}"))
        else:
            after = [*question, _call(), {"role": "tool", "content": str(a + b)}]
            pairs.append((_chat(tokenizer, after, tools), f"{rng.randrange(10)}{END}"))
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
    format_steps = max(1, warmup_steps // FORMAT_STEPS_SHARE) if warmup_steps else 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base)
        # One token each, as in Qwen's tokenizers (added, not special: decoded text keeps them).
        tokenizer.add_tokens(list(TOOL_CALL_TOKENS))
        model.resize_token_embeddings(len(tokenizer))
        warm_up(model, tokenizer, reading_pairs(tokenizer, warmup_steps * WARMUP_BATCH, seed=seed), warmup_steps)
        formats = format_pairs(tokenizer, tools, format_steps * FORMAT_BATCH, seed=seed + 1)
        loss = warm_up(model, tokenizer, formats, format_steps, batch_size=FORMAT_BATCH)
    return save_prepared(model, tokenizer, out_dir, loss, "agent model")


# ---- what the agent did (``python -m rollstream.demo.agent RUN_DIR``) ----------------------


def tool_use(run_dir: Path, window: int = 5) -> list[str]:
    """For the first and last ``window`` weight versions of a run's dumps: the share of
    episodes that used the calculator (their completion holds a ``tool`` turn), the mean
    reward, and the mean reward of those that used it."""
    episodes: dict[int, list[tuple[bool, float]]] = {}
    for path in run_dir.glob("dumps/*/*/rollout/*/*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            used = "<|im_start|>tool" in record["completion"]
            episodes.setdefault(int(path.parent.name), []).append((used, float(record["reward"])))
    versions = sorted(episodes)
    if not versions:
        return [f"no dumps under {run_dir}"]
    lines = []
    for chosen in (versions[:window], versions[-window:]):
        rows = [e for v in chosen for e in episodes[v]]
        rewards = [r for used, r in rows if used]
        lines.append(
            f"versions {chosen[0]}-{chosen[-1]}: {len(rewards) / len(rows):.2f} of {len(rows)} episodes used the "
            f"calculator; reward {sum(r for _, r in rows) / len(rows):.3f} "
            f"(after a tool result {sum(rewards) / max(1, len(rewards)):.3f})"
        )
    return lines


if __name__ == "__main__":
    import sys

    print("\n".join(tool_use(Path(sys.argv[1]))))

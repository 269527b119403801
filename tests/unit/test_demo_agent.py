"""``rollstream demo --agent``'s pieces: config, child environment, warm-up texts (no broker)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from examples.agent_calculator import CALCULATOR, calculate, run_tool
from rollstream.agent.chat_template import ChatRenderer
from rollstream.agent.tool_calls import parse_tool_calls
from rollstream.config import config_from_dict
from rollstream.demo.agent import AGENT_KEY, child_env, format_pairs, reading_pairs, tool_use, with_agent
from rollstream.demo.settings import DemoSettings, demo_config_tree

REPO = Path(__file__).resolve().parents[2]


def test_the_agent_config_runs_the_example_agent(tmp_path: Path) -> None:
    tree = demo_config_tree(DemoSettings(), kafka_bootstrap="k:9092", redis_url="redis://r", experiment="e",
                            run_dir=tmp_path, model_dir=tmp_path / "m", dataset=tmp_path / "d.jsonl")
    rollout = config_from_dict(with_agent(tree)).rollout
    assert rollout.default_workflow == AGENT_KEY
    assert rollout.workflows[AGENT_KEY].path == "examples.agent_calculator:CalculatorAgent"
    assert tree["rollout"].get("default_workflow") is None, "the plain demo's tree is left as it was"
    assert child_env()["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)


def test_the_calculator_evaluates_its_expression_or_the_question() -> None:
    assert run_tool("calculator", json.dumps({"expression": "(2+3)*4"}), "1+1=") == "20"
    assert run_tool("calculator", "{}", "3+4=") == "7"
    assert calculate("__import__('os')").startswith("error")
    assert run_tool("search", "{}").startswith("error")


def test_warm_up_prompts_are_the_endpoints_and_calls_parse(tiny_tokenizer: Any) -> None:
    renderer = ChatRenderer(tiny_tokenizer)
    pairs = format_pairs(tiny_tokenizer, [CALCULATOR], 40, seed=1)
    calls = [completion for _, completion in pairs if completion.startswith("<tool_call>")]
    assert calls and all(c.endswith("<|im_end|>") for c in calls)
    content, parsed = parse_tool_calls(calls[0].removesuffix("<|im_end|>"), {"calculator"})
    assert content is None and [(p.name, p.arguments) for p in parsed] == [("calculator", "{}")]
    question = [{"role": "user", "content": "3+4="}]
    assert renderer.prompt_ids(question, [CALCULATOR]) == tiny_tokenizer.encode(
        tiny_tokenizer.apply_chat_template(question, tools=[CALCULATOR], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)
    prompt, completion = reading_pairs(tiny_tokenizer, 1)[0]
    assert prompt.endswith("<|im_start|>assistant\n") and completion.endswith("<|im_end|>")


def test_tool_use_summarises_a_runs_dumps(tmp_path: Path) -> None:
    def dump(version: int, *episodes: tuple[bool, float]) -> None:
        folder = tmp_path / "dumps" / "e" / "t0" / "rollout" / str(version)
        folder.mkdir(parents=True)
        lines = [json.dumps({"completion": "x<|im_start|>tool\n7" if used else "7", "reward": r}) for used, r in episodes]
        (folder / "task.jsonl").write_text("\n".join(lines) + "\n")

    dump(0, (True, 1.0), (False, 0.0))
    dump(1, (True, 0.0), (True, 1.0))
    first, last = tool_use(tmp_path, window=1)
    assert first == "versions 0-0: 0.50 of 2 episodes used the calculator; reward 0.500 (after a tool result 1.000)"
    assert last.startswith("versions 1-1: 1.00 of 2 episodes") and last.endswith("(after a tool result 0.500)")
    assert tool_use(tmp_path / "nothing") == [f"no dumps under {tmp_path / 'nothing'}"]

"""The demo's task, config, report and child-process pieces (no broker)."""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from rollstream.config import load_config
from rollstream.demo.children import ChildGroup, tier_argv
from rollstream.demo.example_trainer import launcher_argv
from rollstream.demo.report import StepRecord, StepsLog, plot_rewards, reward_trend, weight_reloads
from rollstream.demo.settings import DemoSettings, demo_config_tree, write_config
from rollstream.demo.task import dataset_rows, digit_answer_reward, problems, warmup_texts, write_dataset
from rollstream.dev.processes import pid_alive


@pytest.mark.parametrize(
    ("completion", "reward"),
    [("7", 1.0), ("7<|endoftext|>", 1.0), (" 7 ", 1.0), ("77", 0.0), ("7 8", 0.0), ("17", 0.0), ("", 0.0), ("6", 0.0)],
)
def test_reward_is_exact_match_of_the_answer(completion: str, reward: float) -> None:
    assert digit_answer_reward("3+4=", completion, [], [], answer="7") == reward


def test_reward_without_answer_is_zero() -> None:
    assert digit_answer_reward("3+4=", "7", [], []) == 0.0


def test_dataset_is_balanced_by_answer_and_seeded(tmp_path: Path) -> None:
    rows = dataset_rows(7000, seed=3, max_operand=3)
    assert rows == dataset_rows(7000, seed=3, max_operand=3)
    counts = Counter(row["answer"] for row in rows)
    assert set(counts) == {str(s) for s in range(7)}  # a, b <= 3
    assert max(counts.values()) < 1.2 * min(counts.values())
    for row in rows[:50]:
        a, b = row["prompt"].rstrip("=").split("+")
        assert int(a) + int(b) == int(row["answer"])
    path = write_dataset(tmp_path / "d.jsonl", rows[:3])
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]


def test_every_problem_has_a_one_digit_sum() -> None:
    assert all(a + b < 10 for a, b in problems())
    assert len(problems()) == 55 and len(problems(max_operand=3)) == 16


def test_warmup_never_teaches_sums() -> None:
    pairs = warmup_texts(6000, seed=1)
    sums = [(p, c) for p, c in pairs if "+" in p]
    correct = sum(int(c) == sum(int(x) for x in p.rstrip("=").split("+")) for p, c in sums)
    assert 0.07 < correct / len(sums) < 0.13  # chance level: the digit is random
    for prompt, completion in pairs:
        if "&" in prompt:
            assert completion == prompt[0]
        elif "|" in prompt:
            assert completion == prompt[2]


def test_demo_config_validates_and_names_the_demo_reward(tmp_path: Path) -> None:
    settings = DemoSettings(steps=4, prompts_per_step=2)
    tree = demo_config_tree(settings, kafka_bootstrap="k:1", redis_url="redis://r:2/0", experiment="demo-x",
                            run_dir=tmp_path, model_dir=tmp_path / "model", dataset=tmp_path / "d.jsonl")
    config = load_config(write_config(tree, tmp_path / "config.yaml"), environ={})
    assert config.trainer.max_steps == 4 and config.staleness.groups_per_step == 2
    assert config.reward.reward_fn == "rollstream.demo.task:digit_answer_reward"
    assert config.trainer.group_id == "demo-x-trainer"
    assert config.trainer.max_restarts == settings.trainer_restarts == 3
    assert settings.dataset_size() >= settings.steps * settings.prompts_per_step


def test_the_trainer_runs_under_torchrun_with_restarts() -> None:
    """As ``rollstream train`` and the demo start it: torchrun unless one rank without restarts."""
    assert launcher_argv("t.py", 1, 0) == [sys.executable, "t.py"]
    for ranks in (1, 2):
        argv = launcher_argv("t.py", ranks, 3)
        assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"] and argv[-1] == "t.py"
        assert {f"--nproc-per-node={ranks}", "--max-restarts=3", "--standalone"} <= set(argv)
    with pytest.raises(ValueError, match="ranks >= 1 and max_restarts >= 0"):
        launcher_argv("t.py", 1, -1)


def test_the_steps_log_cuts_a_torn_line_and_appends_whole_ones(tmp_path: Path) -> None:
    log = StepsLog(tmp_path / "steps.jsonl")
    assert log.steps() == []
    record = StepRecord(1, 1, 0.5, 8, 2, 1, 0.1, 0.0, 0.0, 1.0, 0.0, 0, 0, 0, 1.0, 0.0)
    log.append(record)
    with log.path.open("a") as handle:
        handle.write('{"step": 2, "vers')  # a crash inside the write
    assert log.steps() == [1]
    log.append(StepRecord(**{**record.__dict__, "step": 2}))
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [1, 2]


def test_reward_trend_and_plot(tmp_path: Path) -> None:
    trend = reward_trend([0.1, 0.1, 0.2, 0.2, 0.2, 0.5, 0.6, 0.7, 0.8, 0.9])
    assert trend.first == pytest.approx(0.16) and trend.last == pytest.approx(0.7)
    assert trend.line() == "reward mean first 5 steps: 0.160 / last 5 steps: 0.700"
    assert math.isnan(reward_trend([]).first)
    png = plot_rewards(tmp_path / "r.png", [0.1, 0.3, 0.2], "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_weight_reloads_are_read_from_worker_logs(tmp_path: Path) -> None:
    (tmp_path / "a.log").write_text("x now generating with weight version 1 from /c/v1 (load took 0.01s)\n"
                                    "y now generating with weight version 2 from /c/v2\n")
    (tmp_path / "b.log").write_text("z http://127.0.0.1:8000: now at weight version 3 (pause + load + continue 0.07s)\n")
    assert weight_reloads([tmp_path / "a.log", tmp_path / "b.log", tmp_path / "missing.log"]) == [1, 2, 3]


def test_tier_argv_runs_the_cli_module(tmp_path: Path) -> None:
    argv = tier_argv("rollout-worker", tmp_path / "c.yaml", ["rollout.worker_id=w0"])
    assert argv[1:] == ["-m", "rollstream.cli", "rollout-worker", "--config", str(tmp_path / "c.yaml"),
                        "--set", "rollout.worker_id=w0"]


def test_children_are_stopped_and_a_stubborn_one_is_killed(tmp_path: Path) -> None:
    group = ChildGroup(tmp_path / "logs")
    polite = group.start("polite", [sys.executable, "-c", "import time; time.sleep(60)"])
    stubborn = group.start("stubborn", [sys.executable, "-c",
                                        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                        "print('ready', flush=True); time.sleep(60)"])
    for _ in range(100):  # the SIGTERM must arrive after the child ignores it
        if "ready" in stubborn.log_path.read_text():
            break
        time.sleep(0.05)
    pids = [polite.pid, stubborn.pid]
    codes = group.stop_all(grace_seconds=1.0)
    assert codes["polite"] == -15 and codes["stubborn"] == -9
    assert polite.pid is None and not any(pid_alive(pid) for pid in pids)  # type: ignore[arg-type]
    assert {child.name for child in group.failed()} == {"polite", "stubborn"}  # signalled: not 0

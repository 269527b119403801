"""Module-level reward functions, importable by process-pool workers (spawn/forkserver)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any


def _mark(path: str) -> int:
    """Append one line to ``path`` and return how many lines it has now (attempt counter)."""
    with open(path, "a") as f:
        f.write("x\n")
    return len(Path(path).read_text().splitlines())


def add(a: float, b: float) -> float:
    return a + b


def worker_pid() -> int:
    return os.getpid()


def answer_in_completion(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                         answer: str = "", **data: Any) -> float:
    """1.0 when the expected answer word appears in the completion."""
    return 1.0 if answer and answer in completion.split() else 0.0


def prompt_echo(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    """Length of the prompt ids (to check the arguments arrive)."""
    return float(len(prompt_ids))


def sleepy(counter: str, seconds: float) -> float:
    _mark(counter)
    time.sleep(seconds)
    return 1.0


def always_fails(counter: str) -> float:
    _mark(counter)
    raise ValueError("reward exploded")


def fails_then_succeeds(counter: str, failures: int) -> float:
    if _mark(counter) <= failures:
        raise ValueError("transient")
    return 0.75


def killed_once(marker: str) -> float:
    """Kills its worker process on the first call (no marker yet); 1.0 afterwards."""
    if not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def always_killed(counter: str) -> float:
    _mark(counter)
    os.kill(os.getpid(), signal.SIGKILL)
    return 0.0


def list_sum(ids: list[int]) -> float:
    """Sum of ``ids``; refuses anything but a plain list of ints (what reward functions get)."""
    if type(ids) is not list or not all(type(i) is int for i in ids):
        raise TypeError(f"expected a list of ints, got {type(ids).__name__}")
    return float(sum(ids))


class NeedsTwoArgs(Exception):
    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a} and {b}")


def raises_unrebuildable() -> float:
    """Raises an exception that pickles but cannot be rebuilt from its args."""
    raise NeedsTwoArgs("left", "right")


def calls_sys_exit() -> float:
    raise SystemExit(4)


def texts_and_ids_arrive(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                         expected: str = "", **data: Any) -> float:
    """1.0 when ``prompt + " | " + completion`` is ``expected`` and the ids are plain lists of ints."""
    lists = all(type(ids) is list and all(type(i) is int for i in ids) for ids in (prompt_ids, completion_ids))
    return 1.0 if lists and f"{prompt} | {completion}" == expected else 0.0


def sleeping_reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    time.sleep(30)
    return 1.0


def raising_reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    raise ValueError("reward exploded")

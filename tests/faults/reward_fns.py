"""Reward functions that misbehave on purpose, for the reward fault tests.

Module-level and light (no torch): the reward worker's pool processes import this module.
``chaos_reward`` does what the episode's ``data["mode"]`` says and appends ``<mode> <event>
<time>`` lines to ``data["log"]`` so a test can tell when each call ran.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def _note(log: str, mode: str, event: str) -> None:
    if log:
        with open(log, "a") as handle:
            handle.write(f"{mode} {event} {time.time():.6f}\n")


def chaos_reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                 mode: str = "good", log: str = "", **data: Any) -> float:
    """good: 1.0 after 10 ms; hang: never returns; crash: raises; kill: SIGKILLs its own process;
    exit: ``os._exit(3)``."""
    _note(log, mode, "start")
    if mode == "hang":
        time.sleep(3600)
    elif mode == "crash":
        raise RuntimeError("reward function crashed on purpose")
    elif mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "exit":
        os._exit(3)
    time.sleep(0.01)
    _note(log, mode, "end")
    return 1.0

"""What a long fault test is doing, as it happens.

A :class:`Timeline` prints each step with its time since the start (pytest shows a test's
output when it fails, a pytest-timeout included, so a test that dies still says where it was),
and bounds a whole schedule with one deadline whose error names the step in progress and the
steps before it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar


T = TypeVar("T")


class Timeline:
    """Steps of one test run, each stamped with the seconds since the timeline began."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.began = time.monotonic()
        self.steps: list[str] = []

    @property
    def current(self) -> str:
        return self.steps[-1] if self.steps else "(nothing yet)"

    def step(self, text: str) -> None:
        line = f"{time.monotonic() - self.began:6.1f}s {text}"
        self.steps.append(line)
        print(f"[{self.title}] {line}", flush=True)

    async def within(self, awaitable: Awaitable[T], seconds: float, what: str) -> T:
        """``await awaitable``, or fail once ``seconds`` passed naming ``what``, the step in
        progress and the steps so far (the awaitable is cancelled)."""
        bound = asyncio.timeout(seconds)
        try:
            async with bound:
                return await awaitable
        except TimeoutError:
            if not bound.expired():
                raise
            history = "\n".join(self.steps[-30:])
            raise AssertionError(
                f"{self.title}: {what} not done within {seconds:g}s; in progress: {self.current}\n{history}"
            ) from None

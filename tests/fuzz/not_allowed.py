"""A module that a hostile message would like a worker to import. It must never be imported.

``test_input_paths`` names it as a prompt's workflow and as an episode's reward function, then
checks ``sys.modules``: the workers resolve workflows and rewards from their config only.
"""

from __future__ import annotations

from typing import Any


class Evil:
    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> None:
        raise AssertionError("a message chose the workflow")


def evil_reward(*args: Any, **kwargs: Any) -> float:
    raise AssertionError("a message chose the reward function")

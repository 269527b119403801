"""Run several never-ending coroutines as one: the first error ends them all and is raised."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


async def run_together(coroutines: dict[str, Coroutine[Any, Any, Any]]) -> None:
    """Run ``coroutines`` (name -> coroutine) as tasks until one raises (re-raised here) or
    this is cancelled; either way every task is cancelled and awaited before returning."""
    tasks = [asyncio.create_task(coro, name=name) for name, coro in coroutines.items()]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

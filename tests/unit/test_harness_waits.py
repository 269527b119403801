"""The test harness's own waits end: a background task that swallows its cancellation is
stopped anyway (harness/waits.py), and a fault schedule past its deadline names the step in
progress (harness/timeline.py)."""

from __future__ import annotations

import asyncio

import pytest

from harness.timeline import Timeline
from harness.waits import stop_task


async def test_a_task_that_swallows_its_cancellation_is_stopped_anyway() -> None:
    """What held the cluster test for 600 s: a watcher loop whose Redis call lost the
    cancellation (redis-py 8 on Python 3.11) carried on, and the test awaited it forever."""
    swallowed = 0

    async def watcher() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                if swallowed == 0:  # the library's call returned as if nothing happened
                    swallowed += 1
                    continue
                raise

    task = asyncio.create_task(watcher())
    await asyncio.sleep(0.01)
    await asyncio.wait_for(stop_task(task, "the watcher"), 10)
    assert task.cancelled() and swallowed == 1


async def test_a_task_that_never_stops_fails_naming_it() -> None:
    stubborn = True

    async def loop() -> None:
        while True:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                if not stubborn:
                    raise

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)  # running: a task cancelled before its first step never runs
    with pytest.raises(AssertionError, match="the stubborn loop did not stop within 1.5s"):
        await stop_task(task, "the stubborn loop", seconds=1.5)
    stubborn = False
    await stop_task(task, "the loop")


async def test_a_schedule_past_its_deadline_names_the_step_in_progress(capsys: pytest.CaptureFixture[str]) -> None:
    timeline = Timeline("cluster")

    async def schedule() -> None:
        timeline.step("fault 1/2: kill leader of prompts[0]")
        timeline.step("fault 2/2: node 3 resumed; waiting for full ISR")
        await asyncio.sleep(30)

    with pytest.raises(AssertionError) as failed:
        await timeline.within(schedule(), 0.2, "the fault schedule")
    message = str(failed.value)
    assert "the fault schedule not done within 0.2s" in message
    assert "in progress:" in message and message.index("waiting for full ISR") < message.index("\n")
    assert "kill leader of prompts[0]" in message  # the steps before it
    assert "[cluster]" in capsys.readouterr().out  # printed as they happen

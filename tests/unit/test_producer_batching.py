"""Admission waiting and prompt batching, with a fake staleness budget (no broker, no Redis)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from rollstream.producers.admission import Admission
from rollstream.producers.publisher import PendingBatch
from rollstream.producers.service import check_config
from rollstream.config import ConfigError, config_from_dict
from rollstream.wire import ProducerCursor, PromptTask


class FakeBudget:
    """Admits while ``room`` > 0; ``wait_for_room`` sleeps until poked or timed out."""

    def __init__(self, room: int, failures: int = 0) -> None:
        self.room = room
        self.failures = failures  # the next N calls raise a connection error
        self.admitted: set[str] = set()
        self.poked = asyncio.Event()
        self.wait_calls = 0

    async def generation(self) -> str:
        return "g1"

    async def try_admit(self, task_id: str, generation: str | None = None) -> bool:
        if self.failures:
            self.failures -= 1
            raise aioredis.ConnectionError("redis down")
        if task_id in self.admitted:
            return True
        if self.room <= 0:
            return False
        self.room -= 1
        self.admitted.add(task_id)
        return True

    async def wait_for_room(self, timeout: float) -> None:
        self.wait_calls += 1
        try:
            await asyncio.wait_for(self.poked.wait(), timeout)
        except TimeoutError:
            pass
        self.poked.clear()


class PingingClient:
    async def ping(self) -> bool:
        return True


def make_admission(budget: FakeBudget, stop: asyncio.Event, poll: float = 5.0) -> Admission:
    return Admission(budget, PingingClient(), poll, stop)  # type: ignore[arg-type]


async def test_eval_prompts_skip_the_budget() -> None:
    budget = FakeBudget(room=0)
    admission = make_admission(budget, asyncio.Event())
    assert await admission.try_admit("p:0:0", is_eval=True)
    assert budget.admitted == set()


async def test_full_budget_waits_until_room_appears() -> None:
    budget = FakeBudget(room=1)
    admission = make_admission(budget, asyncio.Event())
    assert await admission.try_admit("p:0:0", is_eval=False)
    assert not await admission.try_admit("p:0:1", is_eval=False)

    async def grow() -> None:
        await asyncio.sleep(0.05)
        budget.room += 1
        budget.poked.set()

    started = time.monotonic()
    grower = asyncio.create_task(grow())
    assert await admission.wait_for_room()
    await grower
    assert time.monotonic() - started < 2.0  # woken by the poke, not the 5 s poll
    assert await admission.try_admit("p:0:1", is_eval=False)
    assert admission.waits == 1


async def test_stop_interrupts_the_wait() -> None:
    stop = asyncio.Event()
    admission = make_admission(FakeBudget(room=0), stop)
    asyncio.get_running_loop().call_later(0.05, stop.set)
    started = time.monotonic()
    assert not await admission.wait_for_room()
    assert time.monotonic() - started < 2.0


async def test_redis_outage_is_waited_out_not_skipped() -> None:
    budget = FakeBudget(room=1, failures=2)
    admission = make_admission(budget, asyncio.Event())
    assert await admission.try_admit("p:0:0", is_eval=False)
    assert budget.admitted == {"p:0:0"}


def cursor(index: int) -> ProducerCursor:
    return ProducerCursor(producer_id="p", epoch=0, index=index, published=index)


def test_pending_batch_is_due_when_full_or_lingering() -> None:
    batch = PendingBatch()
    assert batch.is_empty() and not batch.is_due(2, 0.0)
    task = PromptTask(task_id="p:0:0", group_size=2, data={})
    batch.add_prompt(task, b"v", cursor(1))
    assert not batch.is_due(2, 10.0)
    assert batch.is_due(2, 0.0)  # lingered long enough
    batch.add_prompt(PromptTask(task_id="p:0:1", group_size=2, data={}, is_eval=True), b"v", cursor(2))
    assert batch.is_due(2, 10.0)  # full
    assert batch.cursor == cursor(2) and batch.eval_prompts == 1
    assert batch.prompts[0] == (b"p:0:0", b"v")


def test_config_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match="producer.dataset"):
        check_config(config_from_dict({}))
    with pytest.raises(ConfigError, match="producer.admission_poll_seconds"):
        check_config(config_from_dict({"producer": {"dataset": "x.jsonl", "admission_poll_seconds": 0}}))

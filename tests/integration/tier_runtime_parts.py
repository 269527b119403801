"""Tiers whose shutdown or start hangs, for the tier runtime's tests (module-level: named by import string).

Each reads ``scored`` and passes nothing on; at its end it closes "a client that never answers":
:func:`hung` awaits forever (the runtime cancels it at the bound), :func:`stuck` blocks the
event loop itself (only the process's clock thread can end it). :func:`waiting` waits for Redis
in its build (a stop then cuts its start short).
"""

from __future__ import annotations

import asyncio
import time

from aiokafka.structs import ConsumerRecord

from rollstream.config import RollstreamConfig
from rollstream.kafka.consume_transform_produce import PartitionOutput, RecordTransform
from rollstream.tier.context import TierContext
from rollstream.tier.declaration import EXACTLY_ONCE, Reads, Tier

HUNG_CLOSE = "closing a client that never answers"


class Swallow(RecordTransform):
    async def transform(self, record: ConsumerRecord, out: PartitionOutput) -> None:
        pass


async def _build_hung(ctx: TierContext) -> Swallow:
    ctx.on_close(HUNG_CLOSE, asyncio.Event().wait)
    return Swallow()


async def _build_stuck(ctx: TierContext) -> Swallow:
    async def block_the_loop() -> None:
        time.sleep(3600)

    ctx.on_close(HUNG_CLOSE, block_the_loop)
    return Swallow()


async def _build_waiting(ctx: TierContext) -> Swallow:
    await ctx.redis(wait=True)  # a Redis that does not answer: the tier waits here
    return Swallow()


def waiting(config: RollstreamConfig) -> Tier:
    return Tier("waiting-tier", "0", Reads("scored", poll_timeout_ms=100), (), EXACTLY_ONCE, _build_waiting)


def hung(config: RollstreamConfig) -> Tier:
    return Tier("hung-tier", "0", Reads("scored", poll_timeout_ms=100), (), EXACTLY_ONCE, _build_hung)


def stuck(config: RollstreamConfig) -> Tier:
    return Tier("stuck-tier", "0", Reads("scored", poll_timeout_ms=100), (), EXACTLY_ONCE, _build_stuck)

"""The reward worker tier, declared: ``episodes`` -> ``scored``, exactly once.

Each poll batch (at most ``reward.max_batch`` records) is scored concurrently by
:class:`RewardTransform`, and each input partition's scored messages, dead letters and
consumed offset are committed in ONE transaction under that partition's own transactional id
(:mod:`rollstream.tier.runtime`). Readers of ``scored`` use ``read_committed``, so a batch is
seen entirely or not at all, and a crash re-scores only uncommitted records. Whoever takes
partition p fences every earlier partition owner of p (docs/GUARANTEES.md, "Fencing").
``reward.worker_id`` names the worker in logs and client ids; any number of workers may run.
"""

from __future__ import annotations

import logging

from rollstream.config import RollstreamConfig
from rollstream.reward_workers.reward_function import Scorer
from rollstream.reward_workers.transform import TIER, RewardTransform
from rollstream.tier.context import TierContext
from rollstream.tier.declaration import EXACTLY_ONCE, Reads, Tier, default_instance
from rollstream.tier.runtime import entry

log = logging.getLogger(__name__)


def declare(config: RollstreamConfig) -> Tier:
    rc = config.reward
    reads = Reads("episodes", poll_timeout_ms=rc.poll_timeout_ms, max_records=rc.max_batch,
                  session_timeout_ms=rc.session_timeout_ms)
    return Tier(TIER, rc.worker_id or default_instance(), reads, ("scored",), EXACTLY_ONCE, build,
                max_consecutive_failures=rc.max_consecutive_failures)


async def build(ctx: TierContext) -> RewardTransform:
    scorer = Scorer.from_config(ctx.config.reward, ctx.tier.instance)
    transform = RewardTransform(ctx.names, scorer)
    ctx.on_close("closing the reward function's pool", scorer.aclose)
    ctx.on_close("reporting", lambda: _report(ctx, transform))
    return transform


async def _report(ctx: TierContext, transform: RewardTransform) -> None:
    log.info("%s committed %d scored messages", ctx.tier.label, transform.scored)


run = entry(declare)

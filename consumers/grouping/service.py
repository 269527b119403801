"""The grouping tier, declared: ``scored`` samples in, exactly one emitted or dropped record per
group out on ``batches``, exactly once (:class:`~rollstream.consumers.grouping.transform.GroupingTransform`).

Whoever takes partition p registers p's transactional id BEFORE it reads p's changelog and
committed offset; from then on no earlier partition owner of p (crashed, paused, partitioned) can
commit anything for p, and everything such a one committed before is in what the new one reads
(docs/GUARANTEES.md, "Fencing"). ``grouping.instance_id`` names the instance in logs and client
ids only. ``grouping.reads`` names the role it groups (``scored`` unless a tier of your own sits
between).
"""

from __future__ import annotations

from rollstream.config import RollstreamConfig
from rollstream.consumers.grouping.transform import TIER, GroupingTransform
from rollstream.tier.context import TierContext
from rollstream.tier.declaration import EXACTLY_ONCE, Reads, Tier
from rollstream.tier.runtime import entry


def declare(config: RollstreamConfig) -> Tier:
    g = config.grouping
    reads = Reads(g.reads, poll_timeout_ms=g.commit_interval_ms, session_timeout_ms=g.session_timeout_ms,
                  heartbeats_per_session=4)
    return Tier(TIER, g.instance_id, reads, ("batches", "grouping-changelog"), EXACTLY_ONCE, build,
                max_consecutive_failures=g.max_consecutive_failures)


async def build(ctx: TierContext) -> GroupingTransform:
    return GroupingTransform(ctx.config, ctx.names, await ctx.redis())


run = entry(declare)

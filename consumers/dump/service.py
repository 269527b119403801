"""The dump tier, declared: ``scored`` in its own consumer group, at least once, into trajectory
dumps (:class:`~rollstream.consumers.dump.intake.DumpIntake`; line format:
:mod:`rollstream.dump.lines`; with ``dump.fields: extended`` it reads the trainer version and
weight paths from Redis). One writer per sample: with ``rollout.dump_to_file`` true the rollout
workers write the dumps, and this tier refuses to start (:func:`check_single_writer`)."""

from __future__ import annotations

import logging

from rollstream.config import ConfigError, RollstreamConfig
from rollstream.consumers.dump.intake import TIER, DumpIntake
from rollstream.dump.lines import DumpWriter
from rollstream.state.version_store import VersionStore
from rollstream.tier.context import TierContext
from rollstream.tier.declaration import AT_LEAST_ONCE, Reads, Tier, default_instance
from rollstream.tier.runtime import entry

log = logging.getLogger(__name__)

POLL_TIMEOUT_MS = 500
COMMIT_EVERY_CYCLE = 0.0  # the loop's commit interval: each cycle's written offsets


def check_single_writer(config: RollstreamConfig) -> None:
    """``ConfigError`` when the rollout workers write the dumps themselves."""
    if config.rollout.dump_to_file:
        raise ConfigError(
            "rollout.dump_to_file is true: the rollout workers write the trajectory dumps, and the "
            "dump tier would write every sample a second time. Set rollout.dump_to_file=false to "
            "let the dump tier write them, or do not run the dump tier."
        )


def declare(config: RollstreamConfig) -> Tier:
    check_single_writer(config)
    reads = Reads("scored", poll_timeout_ms=POLL_TIMEOUT_MS)
    return Tier(TIER, default_instance(), reads, (), AT_LEAST_ONCE, build,
                commit_interval_seconds=COMMIT_EVERY_CYCLE)


async def build(ctx: TierContext) -> DumpIntake:
    """The writer (with ``dump.fields: extended``, reading versions from Redis) and the
    dead-letter producer; the writer's files are flushed and closed once the consumer stopped."""
    versions = None
    if ctx.config.dump.fields == "extended":  # trainer version and weight paths live in Redis
        versions = VersionStore(await ctx.redis(), ctx.keys)
    writer = DumpWriter.from_config(ctx.config, versions=versions)
    producer = await ctx.producer()
    ctx.on_close("closing the dump files", writer.close)
    log.info("%s writing to %s", ctx.tier.label, writer.root / writer.experiment / writer.trial)
    return DumpIntake(writer, producer, ctx.names)


run = entry(declare)

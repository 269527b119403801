"""AReaL's ``stats_tracker`` in a rollout worker: exported and reset as AReaL's trainer does.

AReaL's tracker keeps every recorded value in memory until ``export_all()``, which AReaL's
trainer calls every step. A workflow runs in a rollout worker here, not beside the trainer, and
nothing else would ever call it: a worker running AReaL workflows would grow by every value
recorded (~32 bytes each) for as long as it runs. :func:`export_areal_stats` exports AReaL's
statistics and resets them, folding them into rollstream's own tracker, whose totals the
worker serves on its metrics endpoint (``rollstream_workflow_stat{key=...}``: a scalar's values
keep their sum and count; a value AReaL reduced itself, e.g. ``.../avg``, counts once per
export). :func:`export_periodically` does it for the worker's lifetime.

Nothing here imports ``areal``: without a workflow that imported AReaL's tracker there is
nothing to export.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from rollstream.runtime.stats import StatsTracker, stats_tracker

log = logging.getLogger(__name__)

AREAL_STATS_MODULE = "areal.utils.stats_tracker"
COUNT_SUFFIX = "__count"  # AReaL's export: "<key>" is a scalar's mean, "<key>__count" its count
EXPORT_SECONDS = 10.0


def export_areal_stats(into: StatsTracker = stats_tracker) -> int:
    """Export AReaL's statistics recorded since the last export, reset its tracker, add them to
    ``into``; the number of keys exported (0: AReaL's tracker is not imported, or empty)."""
    module = sys.modules.get(AREAL_STATS_MODULE)
    if module is None:
        return 0
    exported: dict[str, float] = module.export_all(reset=True)
    counts = {key[: -len(COUNT_SUFFIX)]: int(n) for key, n in exported.items() if key.endswith(COUNT_SUFFIX)}
    for key, value in exported.items():
        if key.endswith(COUNT_SUFFIX) or value is None:
            continue
        n = counts.get(key, 1)
        into.absorb(key, float(value) * n, n)
    return len(exported)


async def export_periodically(every: float = EXPORT_SECONDS, into: StatsTracker = stats_tracker) -> None:
    """:func:`export_areal_stats` every ``every`` seconds until cancelled; a failing export is
    logged and tried again (statistics are never worth a worker)."""
    while True:
        await asyncio.sleep(every)
        try:
            export_areal_stats(into)
        except Exception as exc:  # noqa: BLE001 - AReaL's export raising must not stop generation
            log.warning("exporting AReaL's statistics failed: %s: %s", type(exc).__name__, exc)

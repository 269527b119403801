"""The report text of a fault run's :class:`~harness.pipeline.Outcome`."""

from __future__ import annotations

from harness.pipeline import Outcome


def report(title: str, out: Outcome, extra: dict[str, object]) -> str:
    lines = [
        f"== {title}",
        f"prompts {out.prompts}: admitted {out.admitted} (prompt records {out.prompt_records}), "
        f"emitted groups {out.emitted}, dropped {sum(out.dropped.values())} by reason {out.dropped or {}}",
        f"duplicates in batches: tasks {out.duplicate_tasks}, rows {out.duplicate_rows}; "
        f"samples on episodes {out.episode_records} of which distinct {out.distinct_samples} "
        f"(re-run duplicates removed by grouping: {out.episode_records - out.distinct_samples})",
        f"versions published {out.versions}; staleness budget in Redis {out.budget}",
        f"kills per tier {out.kills}; restarts per tier {out.restarts}; "
        f"unexpected exits {out.unexpected_exits or 'none'}",
        *(f"{k}: {v}" for k, v in extra.items()),
        f"took {out.seconds:.0f}s",
    ]
    return "\n".join(lines)

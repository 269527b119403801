"""The chaos run's report: faults by kind and as they happened, each invariant with its count,
every violation with what it saw, the figures, the targets (bench/common.py's ``Report``)."""

from __future__ import annotations

from bench.chaos import invariants as inv
from bench.chaos.run import Result
from bench.chaos.schedule import ALL_KINDS, KINDS
from bench.common import Report

FAULTS_PER_MINUTE = 2  # the target: 60 in 30 minutes
# the tiers read these before their config file: the run's own cluster and Redis must win
FOREIGN_ENV = ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL")


def report(result: Result, out: Report) -> None:
    """Print the run's tables and figures into ``out`` and set its targets."""
    s = result.settings
    kinds = result.by_kind()
    drawn = ALL_KINDS if s.engine == "vllm" else KINDS
    out.table("Faults by kind", [{"kind": k, "carried out": kinds.get(k, 0)} for k in drawn]
                 + [{"kind": "total", "carried out": len(result.done)}])
    out.table("Faults as they happened", [
        {"at (s)": d.began, "fault": d.fault.kind, "target": d.fault.target, "lasting (s)": d.fault.seconds,
         "took (s)": d.took, "note": d.note} for d in result.done])
    counts = inv.by_invariant(result.violations)
    out.table("Invariants", [{"invariant": name, "violations": counts.get(name, 0)} for name in inv.INVARIANTS])
    for violation in result.violations:
        out.note(f"VIOLATION [{violation.invariant}] {violation.saw}")
    for name, lines in result.exits.items():
        out.note(f"{name} exited unasked (restarted): " + " | ".join(lines))
    out.extra.update({"seed": s.seed, "minutes": s.minutes, "mean gap (s)": s.mean_gap, "engine": s.engine,
                         "faults planned": len(result.planned), "faults carried out": len(result.done),
                         "faults by kind": dict(kinds), "violations": len(result.violations),
                         "violations by invariant": dict(counts), "unasked exits": result.exits,
                         **result.figures})
    print("\nFigures")
    for key, value in out.extra.items():
        print(f"  {key}: {value}")
    out.target("faults carried out", len(result.done), FAULTS_PER_MINUTE * s.minutes)
    out.target("violations", len(result.violations), 0, higher_is_better=False)

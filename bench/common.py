"""Shared pieces of the benchmark scripts: timing, tables, targets, machine facts, results.

Every script prints a table, then one line per target (``PASS``/``FAIL``), and writes the same
figures as JSON (``--out``, default ``bench/results/<name>.json``). Exit status: 0 when every
target passed (or the script has none), 1 when one failed; the CI smoke test ignores targets
(``--quick`` sizes are far too small to measure anything).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def base_parser(name: str, description: str) -> argparse.ArgumentParser:
    # aiokafka logs errors while a fresh broker elects its group coordinator (it retries); real
    # failures still surface as exceptions, and the tables are the output
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    parser = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=description)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not a measurement")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON results (default bench/results/{name}.json; '-' for none)")
    return parser


def run_bench(
    name: str, doc: str | None, arguments: Callable[[argparse.ArgumentParser], None],
    measure: Callable[[argparse.Namespace, Report], Awaitable[None]], argv: list[str] | None,
) -> int:
    """A benchmark's ``main``: its parser (``--quick``, ``--out`` and what ``arguments`` adds),
    ``measure(args, report)`` on an event loop, then the report printed and saved."""
    parser = base_parser(name, (doc or name).splitlines()[0])
    arguments(parser)
    args = parser.parse_args(argv)
    report = Report(name, args.quick)
    asyncio.run(measure(args, report))
    return report.finish(args.out)


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def machine() -> dict[str, Any]:
    """What the figures were measured on (cores, CPU model, load average at the start)."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in load_average()],
    }


def time_per_call(fn: Callable[[], object], total_seconds: float = 0.3, loop_seconds: float = 0.002) -> float:
    """Seconds per call of ``fn``: the fastest of many short timed loops (``loop_seconds`` each,
    ``total_seconds`` in all, at least 5 loops).

    The minimum of short loops, not the mean of long ones: on a shared machine other jobs only
    ever add time, and a loop of a few milliseconds often fits in one scheduler slice, so the
    fastest loop is the best estimate of the code's own cost.
    """
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    loops = max(1, int(loop_seconds / once))
    repeats = max(5, int(total_seconds / (once * loops)))
    best = float("inf")
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(loops):
                fn()
            best = min(best, (time.perf_counter() - start) / loops)
    finally:
        if gc_was:
            gc.enable()
    return best


def time_interleaved(fns: dict[str, Callable[[], object]], total_seconds: float = 1.0,
                     loop_seconds: float = 0.002) -> dict[str, float]:
    """Seconds per call of each function, their short timed loops taken in turn (round robin),
    the fastest loop of each kept: every function meets the same moments of a shared machine,
    so their ratios hold even when its load changes during the run."""
    loops: dict[str, int] = {}
    for name, fn in fns.items():
        fn()
        start = time.perf_counter()
        fn()
        loops[name] = max(1, int(loop_seconds / max(time.perf_counter() - start, 1e-7)))
    best = {name: float("inf") for name in fns}
    deadline = time.perf_counter() + total_seconds
    rounds = 0
    gc_was = gc.isenabled()
    gc.disable()
    try:
        while rounds < 5 or time.perf_counter() < deadline:
            for name, fn in fns.items():
                n = loops[name]
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - start) / n)
            rounds += 1
    finally:
        if gc_was:
            gc.enable()
    return best


def memcpy_seconds(nbytes: int, total_seconds: float = 0.3) -> float:
    """Seconds to copy ``nbytes`` with ``numpy.copyto`` between two preallocated buffers."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return time_per_call(lambda: np.copyto(dst, src), total_seconds)


def alloc_copy_seconds(nbytes: int, total_seconds: float = 0.3) -> float:
    """Seconds to copy ``nbytes`` into a NEW bytes object (allocation + copy, ``bytes(bytearray)``)."""
    src = bytearray(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tobytes())
    return time_per_call(lambda: bytes(src), total_seconds)


def percentiles(values: Sequence[float], points: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    if not values:
        return {f"p{p:g}": float("nan") for p in points}
    arr = np.asarray(values, dtype=float)
    return {f"p{p:g}": float(np.percentile(arr, p)) for p in points}


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


@dataclass
class Target:
    name: str
    value: float
    threshold: float
    higher_is_better: bool = True
    unit: str = ""

    @property
    def passed(self) -> bool:
        if self.value != self.value:  # NaN never passes
            return False
        return self.value >= self.threshold if self.higher_is_better else self.value <= self.threshold

    def line(self) -> str:
        op = ">=" if self.higher_is_better else "<="
        verdict = "PASS" if self.passed else "FAIL"
        return f"{verdict}  {self.name}: {fmt(self.value)}{self.unit} (target {op} {fmt(self.threshold)}{self.unit})"


@dataclass
class Report:
    """One script's figures: tables (rows of dicts), targets, notes; printed and saved."""

    name: str
    quick: bool
    machine: dict[str, Any] = field(default_factory=machine)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def table(self, title: str, rows: list[dict[str, Any]]) -> None:
        self.tables[title] = rows
        print_table(title, rows)

    def target(self, name: str, value: float, threshold: float, higher_is_better: bool = True, unit: str = "") -> Target:
        target = Target(name, value, threshold, higher_is_better, unit)
        self.targets.append(target)
        return target

    def note(self, text: str) -> None:
        self.notes.append(text)

    def finish(self, out: Path | None) -> int:
        """Print targets and notes, write the JSON; the exit status (1: a target failed)."""
        self.machine["load_average_at_end"] = [round(x, 2) for x in load_average()]
        if self.targets:
            print("\nTargets" + (" (--quick: sizes too small, verdicts are not meaningful)" if self.quick else ""))
            for target in self.targets:
                print("  " + target.line())
        for text in self.notes:
            print(f"note: {text}")
        print(f"machine: {self.machine['cpus']} CPUs ({self.machine['cpu_model']}), load average "
              f"{self.machine['load_average_at_start']} at start, {self.machine['load_average_at_end']} at end")
        if str(out) != "-":
            path = out or RESULTS_DIR / (f"{self.name}.quick.json" if self.quick else f"{self.name}.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            payload = asdict(self)
            payload["targets"] = [{**asdict(t), "passed": t.passed} for t in self.targets]
            path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
            print(f"results: {path}")
        return 0 if all(t.passed for t in self.targets) else 1


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "n/a"
        magnitude = abs(value)
        if magnitude >= 1000:
            return f"{value:,.0f}"
        if magnitude >= 100:
            return f"{value:.0f}"
        if magnitude >= 10:
            return f"{value:.1f}"
        if magnitude >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    if not rows:
        print("  (no rows)")
        return
    columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(columns, widths))))
    print("  " + "  ".join("-" * w for w in widths))
    for row in cells:
        print("  " + "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))))

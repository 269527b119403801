"""Memory benchmark: peak RSS of each tier under the pipeline load, and the grouping consumer's
memory as groups pass (bounded by the open groups and the dedupe window, not by history).

Part 1 runs ``bench/pipeline.py``'s pipeline (every tier in its own process, the LOAD
GENERATOR engine), plus a dump tier reading ``scored``, and reads each tier's RSS once it is
ready (idle) and its peak (VmHWM) under load; "with children" adds the reward tier's process
pool. Target: the tiers that run no model (producer, reward worker, grouping, dump; they never
import torch) peak under 150 MB each (the reward worker's own process; its pool's processes
run the reward function). ``--compare before.json`` prints an earlier run's tier figures (say,
``--out before.json`` on the previous commit) beside this run's.

Part 3 (``bench/workflow_memory.py``): a rollout worker running AReaL's ``RLVRWorkflow`` for 20k
episodes, its AReaL ``stats_tracker`` never exported (what a worker did) and exported by the
worker's periodic export: the values AReaL holds and the RSS at checkpoints.

Part 2 feeds a ``GroupBuffer`` in this process as the grouping tier does (decode each
``scored`` record, add, build + encode the batch of each complete group, expire old outcomes
against the watermark) with a fixed number of open groups, and records RSS and Python's
allocated blocks after 1k and 20k emitted groups. The clock is simulated at ``--groups-per-
second`` with ``--dedupe-window`` seconds of outcomes kept, so both checkpoints hold a full
window: growth between them would be memory that depends on how many groups have passed.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from bench.common import Report, base_parser
from bench.data import trajectory
from bench.pipeline_run import PipelineSettings, memory_rows, run_pipeline
from bench.workflow_memory import workflow_memory
from harness.procstats import rss_bytes
from harness.services import services
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.consumers.grouping.groups import CompleteGroup, GroupBuffer
from rollstream.wire import Episode, ScoredEpisode, decode_scored, encode
from rollstream.wire.torch_tensors import encode_tensor_dict


MB = 1e6
GROUP_SIZE = 8
MODEL_FREE_TIERS = ("producer", "reward-worker", "grouping", "dump")  # no model runs there: no torch, small
MAX_MODEL_FREE_RSS_MB = 150.0


def tier_memory(report: Report, quick: bool, compare: Path | None) -> None:
    settings = PipelineSettings(prompts=4 if quick else 200, prompt_tokens=64 if quick else 512,
                                completion_tokens=128 if quick else 1536, timeout_s=90 if quick else 150,
                                confirm_ready=not quick, extra_tiers=("dump",))
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp, services(Path(tmp)) as dev:
        result = asyncio.run(run_pipeline(dev.services, Path(tmp) / "pipeline", settings))
    rows = memory_rows(result)
    report.table(f"Tier memory under the pipeline load ({result.groups} groups of {settings.group_size}, "
                 f"{settings.prompt_tokens}+{settings.completion_tokens} tokens)", rows)
    report.extra["tiers"] = rows
    if compare is not None:
        report.table(f"Peak RSS / peak private MB per tier: {compare} (before) and this run (now)",
                     side_by_side(json.loads(compare.read_text())["extra"]["tiers"], rows))
    for row in rows:
        if row["tier"] in MODEL_FREE_TIERS:
            report.target(f"{row['tier']}: peak RSS under the pipeline load", row["peak RSS MB"],
                          MAX_MODEL_FREE_RSS_MB, higher_is_better=False, unit=" MB")
    report.note(f"`import torch` alone is {import_rss('torch') / MB:.0f} MB of RSS here (mostly shared library "
                "pages, counted in every process's RSS): 'peak private' is what each tier holds alone")


def side_by_side(before: list[dict[str, Any]], now: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per tier of either run: its peak RSS and peak private memory before and now."""
    old = {row["tier"]: row for row in before}
    new = {row["tier"]: row for row in now}
    nan = float("nan")
    return [{
        "tier": tier,
        "peak RSS before": old.get(tier, {}).get("peak RSS MB", nan),
        "peak RSS now": new.get(tier, {}).get("peak RSS MB", nan),
        "peak private before": old.get(tier, {}).get("peak private MB", nan),
        "peak private now": new.get(tier, {}).get("peak private MB", nan),
    } for tier in [*new, *(t for t in old if t not in new)]]


class ScoredStream:
    """Encoded ``scored`` records for group after group (one template, a new task id each)."""

    def __init__(self, tokens: int) -> None:
        tensors = [encode_tensor_dict(trajectory(tokens // 4, tokens - tokens // 4, seed=i)) for i in range(GROUP_SIZE)]
        self._episodes = [Episode(task_id="x", sample_idx=i, group_size=GROUP_SIZE, trajectory=t, head_version=0,
                                  tail_version=0) for i, t in enumerate(tensors)]

    def record(self, group: int, sample: int) -> bytes:
        episode = msgspec.structs.replace(self._episodes[sample], task_id=f"bench:0:{group}")
        return encode(ScoredEpisode(episode=episode, reward=float(sample % 2)))


def buffer_memory(report: Report, quick: bool, open_groups: int, rate: float, window: float) -> bool:
    checkpoints = [100, 400] if quick else [1000, 5000, 10000, 20000]
    stream = ScoredStream(256)
    buffer = GroupBuffer(group_timeout_seconds=3600.0, dedupe_window_seconds=window)
    offset, emitted, rows = 0, 0, []
    now = 0.0

    def add(group: int, sample: int) -> None:
        nonlocal offset, emitted
        for result in buffer.add(decode_scored(stream.record(group, sample)), 0, offset, now):
            assert isinstance(result, CompleteGroup)
            encode(build_emitted_group(result, trainer_version=0))
            emitted += 1
        offset += 1

    for g in range(checkpoints[-1] + open_groups):
        now = g / rate
        for s in range(GROUP_SIZE - 1):  # group g opens with all but its last sample
            add(g, s)
        if g >= open_groups:  # ... and group g - open_groups completes
            add(g - open_groups, GROUP_SIZE - 1)
        mark = buffer.watermark(0)
        buffer.outcomes.expired(now, {0: mark} if mark is not None else {})
        if emitted in checkpoints and (not rows or rows[-1]["emitted groups"] != emitted):
            gc.collect()
            rows.append({"emitted groups": emitted, "open groups": buffer.open_count(),
                         "outcomes kept": len(buffer.outcomes), "RSS MB": rss_bytes(os.getpid()) / MB,
                         "Python blocks": sys.getallocatedblocks()})
    report.table(f"GroupBuffer as groups pass ({open_groups} open, {rate:g} groups/s simulated, "
                 f"dedupe window {window:g} s, decode+add+build+encode per record)", rows)
    first, last = rows[0], rows[-1]
    growth_mb = last["RSS MB"] - first["RSS MB"]
    per_group = 1e6 * growth_mb / (last["emitted groups"] - first["emitted groups"])
    report.target(f"RSS growth from {first['emitted groups']:,} to {last['emitted groups']:,} emitted groups",
                  growth_mb, 8.0, higher_is_better=False, unit=" MB")
    report.note(f"{per_group:.0f} bytes of RSS per emitted group between the checkpoints; Python blocks "
                f"{first['Python blocks']:,} -> {last['Python blocks']:,}")
    report.note(f"outcomes are kept for grouping.dedupe_window_seconds (default 3600 s): about "
                f"{outcome_entry_bytes():.0f} B each, so e.g. 10 groups/s keeps 36k outcomes, "
                f"~{36000 * outcome_entry_bytes() / MB:.0f} MB")
    return True


def import_rss(module: str) -> int:
    """RSS of a fresh Python process that imported ``module``."""
    import subprocess

    code = f"import {module}; print(open('/proc/self/statm').read().split()[1])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.strip()) * os.sysconf("SC_PAGE_SIZE")


def outcome_entry_bytes() -> float:
    """Python heap per OutcomeLog entry (a measured average over 20k entries)."""
    import tracemalloc

    from rollstream.consumers.grouping.outcomes import OutcomeLog

    log = OutcomeLog(3600.0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(20000):
        log.record(f"producer-0:0:{i}", "emitted", float(i), i % 4, i)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / 20000


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("memory", __doc__.splitlines()[0])
    parser.add_argument("--open-groups", type=int, default=64)
    parser.add_argument("--groups-per-second", type=float, default=20.0, help="simulated emission rate")
    parser.add_argument("--dedupe-window", type=float, default=30.0, help="grouping.dedupe_window_seconds")
    parser.add_argument("--skip-tiers", action="store_true", help="no tier part (no broker)")
    parser.add_argument("--skip-workflows", action="store_true", help="no AReaL workflow part")
    parser.add_argument("--only-workflows", action="store_true", help="only the AReaL workflow part")
    parser.add_argument("--compare", type=Path, default=None,
                        help="an earlier run's results JSON (e.g. --out before.json on the previous commit): "
                             "its tier figures beside this run's")
    args = parser.parse_args(argv)
    report = Report("memory", args.quick)
    if not args.skip_workflows:
        workflow_memory(report, args.quick)
    if args.only_workflows:
        return report.finish(args.out)
    buffer_memory(report, args.quick, args.open_groups, args.groups_per_second, args.dedupe_window)
    if not args.skip_tiers:
        tier_memory(report, args.quick, args.compare)
    return report.finish(args.out)


if __name__ == "__main__":
    sys.exit(main())

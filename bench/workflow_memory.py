"""A rollout worker's memory while AReaL workflows record statistics (part of ``bench.memory``).

AReaL's ``stats_tracker`` keeps every recorded value until ``export_all()``, which AReaL's
trainer calls each step and nothing in a rollout worker would call: the worker grows with every
episode. The rollout worker exports and resets it every 10 s into its metrics
(``rollstream.areal.stats.export_periodically``). This runs AReaL's own ``RLVRWorkflow``
(areal installed) episode after episode in this process, as a worker does (rollstream's AReaL
adapter, the tiny model's tokenizer, AReaL's reward process pool, a scripted engine answering
at once), twice: without the export (what a worker did before) and with the worker's export
running; at checkpoints it reads the values AReaL's trackers hold and this process's RSS.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import time
from typing import Any

from bench.common import Report
from harness.procstats import rss_bytes
from harness.services import tokenizer_path
from rollstream.areal.stats import export_periodically
from rollstream.api.context import workflow_context
from rollstream.runtime.stats import StatsTracker


MB = 1e6
EXPORT_SECONDS = 2.0  # the worker's is 10 s; shorter here so that a quick run exports too
DATA = {"messages": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"}


def answer_reward(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    """1.0 when the completion holds the answer (module level: AReaL's pool pickles it)."""
    return 1.0 if str(data.get("answer")) in re.findall(r"\d+", completions) else 0.0


def _areal() -> tuple[Any, Any]:
    from rollstream.runtime.import_effects import undo_import_effects

    import areal.api.cli_args as cli_args
    import areal.utils.stats_tracker as stats_tracker
    from areal.workflow.rlvr import RLVRWorkflow
    from transformers import AutoTokenizer

    undo_import_effects()  # AReaL's logging and event-loop policy, put back as the worker does
    tok = AutoTokenizer.from_pretrained(str(tokenizer_path()))
    workflow = RLVRWorkflow(reward_fn=answer_reward, gconfig=cli_args.GenerationHyperparameters(max_new_tokens=4),
                            tokenizer=tok)
    return stats_tracker, (workflow, tok)


def held(stats_tracker: Any) -> int:
    """Values AReaL's trackers hold now."""
    return sum(len(v) for t in stats_tracker.TRACKERS.values() for v in t.stats.values())


async def _episodes(n: int, checkpoints: list[int], export: bool) -> list[dict[str, Any]]:
    from rollstream.areal.workflow import ArealWorkflow
    from rollstream.testing import ScriptedEngine

    stats_tracker, (areal_workflow, tok) = _areal()
    stats_tracker.export_all(reset=True)
    workflow = ArealWorkflow(areal_workflow)
    engine = ScriptedEngine([tok.encode("4") + [tok.eos_token_id]], vocab_size=len(tok), tokenizer=tok)
    exporter = asyncio.create_task(export_periodically(EXPORT_SECONDS, StatsTracker())) if export else None
    rows, began = [], time.monotonic()
    try:
        for i in range(1, n + 1):
            with workflow_context.scope(task_id=f"bench:0:{i}", is_eval=False, sample_idx=0):
                await workflow.arun_episode(engine, dict(DATA))
            engine.requests.clear()  # the scripted engine keeps every request for tests; a real one does not
            if i in checkpoints:
                gc.collect()
                rows.append({"export": "every %gs" % EXPORT_SECONDS if export else "never", "episodes": i,
                             "values AReaL holds": held(stats_tracker), "RSS MB": rss_bytes(os.getpid()) / MB,
                             "seconds": round(time.monotonic() - began, 1)})
    finally:
        if exporter is not None:
            exporter.cancel()
            await asyncio.gather(exporter, return_exceptions=True)
        stats_tracker.export_all(reset=True)
    return rows


def workflow_memory(report: Report, quick: bool) -> None:
    """Both runs, the table and the targets (values held stay bounded; RSS flat)."""
    n = 400 if quick else 20_000
    checkpoints = [100, 400] if quick else [1000, 5000, 10000, 20000]
    # the worker's way first: a run that never exports, first, would leave freed memory behind
    # that the second run reuses, hiding its growth
    after = asyncio.run(_episodes(n, checkpoints, export=True))
    before = asyncio.run(_episodes(n, checkpoints, export=False))
    report.table(f"A rollout worker running AReaL's RLVRWorkflow ({n:,} episodes, AReaL's stats_tracker "
                 "exported by the worker or never)", after + before)
    report.extra["areal stats memory"] = after + before
    first, last = after[0], after[-1]
    report.target(f"values AReaL's tracker holds after {n:,} episodes with the worker's export", last["values AReaL holds"],
                  n // 10, higher_is_better=False)
    report.target(f"RSS growth from {first['episodes']:,} to {last['episodes']:,} episodes with the export",
                  last["RSS MB"] - first["RSS MB"], 8.0, higher_is_better=False, unit=" MB")
    report.note(f"without the export AReaL's tracker held {before[-1]['values AReaL holds']:,} values after "
                f"{before[-1]['episodes']:,} episodes (one per recorded value: it never lets go), and the RSS grew "
                f"{before[-1]['RSS MB'] - before[0]['RSS MB']:.1f} MB from {before[0]['episodes']:,} episodes")

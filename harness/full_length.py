"""A workflow whose samples always run to ``max_new_tokens``: for tests that need a long,
predictable generation window (a weight update or a fleet change landing mid-generation).

It is rollstream's RLVR workflow with no stop token and eos ignored. ``min_new_tokens`` would
give the same window but masks the stop tokens before each logprob, which a training episode
may not do (``rollstream.engines.logprob_definition``); this leaves the logprobs as the trainer
recomputes them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollstream.api.context import workflow_context
from rollstream.api.io_struct import GenerationHyperparameters
from rollstream.workflows.rlvr import RLVRWorkflow

# rollout.workflows entries that make it (or its gated form) the default workflow ("rlvr")
FULL_LENGTH_RLVR = {"rlvr": {"path": "harness.full_length:FullLengthRLVR",
                             "kwargs": {"gconfig": "$gconfig", "tokenizer": "$tokenizer"}}}
GATED_FULL_LENGTH_RLVR = {"rlvr": {**FULL_LENGTH_RLVR["rlvr"], "path": "harness.full_length:GatedFullLengthRLVR"}}
# What held samples of GatedFullLengthRLVR wait for (workers that run in the test's process).
GATE = asyncio.Event()
OPEN_TASK = "task-0"  # the one task whose samples never wait


class FullLengthRLVR(RLVRWorkflow):
    """:class:`RLVRWorkflow` whose every sample generates ``gconfig.max_new_tokens`` tokens."""

    def __init__(self, gconfig: GenerationHyperparameters, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(gconfig, tokenizer, **kwargs)
        self.gconfig = self.gconfig.new(stop_token_ids=[], ignore_eos=True)


class GatedFullLengthRLVR(FullLengthRLVR):
    """:class:`FullLengthRLVR` whose samples, except those of :data:`OPEN_TASK`, end only once
    :data:`GATE` is set: a test decides when prompts may finish (e.g. only after their
    partitions moved), however fast or slow the machine generates."""

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        result = await super().arun_episode(engine, data)
        if workflow_context.task_id != OPEN_TASK:
            await GATE.wait()
        return result

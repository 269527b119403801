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

from rollstream.api.io_struct import GenerationHyperparameters
from rollstream.workflows.rlvr import RLVRWorkflow

# rollout.workflows entries that make it (or its gated form) the default workflow ("rlvr")
FULL_LENGTH_RLVR = {"rlvr": {"path": "harness.full_length:FullLengthRLVR",
                             "kwargs": {"gconfig": "$gconfig", "tokenizer": "$tokenizer"}}}
GATED_FULL_LENGTH_RLVR = {"rlvr": {**FULL_LENGTH_RLVR["rlvr"], "path": "harness.full_length:GatedFullLengthRLVR"}}
# What held samples of GatedFullLengthRLVR wait for (workers that run in the test's process),
# once OPEN_SAMPLES samples went through (close_gate() starts over).
GATE = asyncio.Event()
OPEN_SAMPLES = 2
_let_through = 0


def close_gate() -> None:
    """Hold every sample of :class:`GatedFullLengthRLVR` after the next :data:`OPEN_SAMPLES`."""
    global _let_through
    GATE.clear()
    _let_through = 0


class FullLengthRLVR(RLVRWorkflow):
    """:class:`RLVRWorkflow` whose every sample generates ``gconfig.max_new_tokens`` tokens."""

    def __init__(self, gconfig: GenerationHyperparameters, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(gconfig, tokenizer, **kwargs)
        self.gconfig = self.gconfig.new(stop_token_ids=[], ignore_eos=True)


class GatedFullLengthRLVR(FullLengthRLVR):
    """:class:`FullLengthRLVR` whose samples, after the first :data:`OPEN_SAMPLES` to finish
    generating, end only once :data:`GATE` is set: a test decides when prompts may finish (e.g.
    only after their partitions moved), however fast or slow the machine generates. The first
    ones pass whichever prompts the worker started first, so nothing waits on a held slot."""

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        global _let_through
        result = await super().arun_episode(engine, data)
        if _let_through < OPEN_SAMPLES:
            _let_through += 1
        else:
            await GATE.wait()
        return result

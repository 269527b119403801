"""A workflow whose samples always run to ``max_new_tokens``: for tests that need a long,
predictable generation window (a weight update or a fleet change landing mid-generation).

It is rollstream's RLVR workflow with no stop token and eos ignored. ``min_new_tokens`` would
give the same window but masks the stop tokens before each logprob, which a training episode
may not do (``rollstream.engines.logprob_definition``); this leaves the logprobs as the trainer
recomputes them.
"""

from __future__ import annotations

from typing import Any

from rollstream.api.io_struct import GenerationHyperparameters
from rollstream.workflows.rlvr import RLVRWorkflow

# rollout.workflows entry that makes it the default workflow ("rlvr") of a test's config
FULL_LENGTH_RLVR = {"rlvr": {"path": "harness.full_length:FullLengthRLVR",
                             "kwargs": {"gconfig": "$gconfig", "tokenizer": "$tokenizer"}}}


class FullLengthRLVR(RLVRWorkflow):
    """:class:`RLVRWorkflow` whose every sample generates ``gconfig.max_new_tokens`` tokens."""

    def __init__(self, gconfig: GenerationHyperparameters, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(gconfig, tokenizer, **kwargs)
        self.gconfig = self.gconfig.new(stop_token_ids=[], ignore_eos=True)

"""A vLLM worker extension: load a checkpoint directory in place, tied word embeddings included.

Runs INSIDE a vLLM server (its own environment: this module imports nothing of rollstream and
nothing but torch beyond the standard library). Start the server with
``--worker-extension-cls rollstream.engines.vllm_worker_extension.WeightLoader`` (the package
installed with ``--no-deps``, or the repository on ``PYTHONPATH``); the weight-sync owner then
calls ``POST /collective_rpc {"method": "rollstream_load_weights", "args": [DIR]}``.

Why not vLLM's own ``reload_weights``: in vLLM 0.32 its layer-wise in-place reload never
loads the LM head of a model with tied word embeddings (Qwen2.5 0.5B-3B, our tiny models): the
checkpoint holds no ``lm_head.weight``, so vLLM logs "ParallelLMHead: Failed to load weights" and
keeps the head's OLD kernel form (on CPU a packed copy of the old embedding). The server then samples with new layers and the old output head, and
its logprobs match no checkpoint (measured: up to 0.011 nats off a fresh forward pass of the
new weights, against 0 before the load). This extension runs that same reload, then ties the
head to the freshly loaded embedding again and lets its quantization method re-process it (on
CPU that rebuilds the packed GEMM weight).
"""

from __future__ import annotations

from typing import Any


class WeightLoader:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    model_runner: Any  # set by vLLM's worker

    def rollstream_ping(self) -> str:
        """Proof that the extension is installed (``VLLMAdmin.check_api`` calls it at start)."""
        return "rollstream"

    def rollstream_load_weights(self, weights_path: str) -> str:
        """Load the checkpoint in ``weights_path`` in place; returns what was done, in words."""
        self.model_runner.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        retied = retie_word_embeddings(model)
        return f"loaded {weights_path}" + (" (word embeddings tied again)" if retied else "")


def retie_word_embeddings(model: Any) -> bool:
    """Point the LM head at the input embedding again when the model ties them and the reload
    separated them; True when it did."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return False
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None:
        return False
    if head.weight is not embed.weight:
        head.weight = embed.weight
    # Shared or not, the head's kernel form was made from the old values (on CPU a packed copy
    # of the weight): make it again from the loaded embedding.
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True

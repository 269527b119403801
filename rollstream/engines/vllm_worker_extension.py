"""A vLLM worker extension: load weights in place, all or nothing, fenced by the sync owner's epoch.

Runs INSIDE a vLLM server's workers (their own environment: this module imports nothing of
rollstream but :mod:`rollstream.engines.weight_transfer`, and nothing but torch and vLLM beyond the
standard library). Start the server with
``--worker-extension-cls rollstream.engines.vllm_worker_extension.WeightLoader`` (and the weight
fence, ``rollstream.engines.vllm_weight_fence``); ``rollstream.dev.vllm_server`` puts both on the
server's ``PYTHONPATH``. The sync owner calls, through ``POST /collective_rpc``:

* ``rollstream_load_weights(path, epoch)``: a checkpoint directory;
* ``rollstream_receive_weights(request)``: a version sent by the trainer over a torch.distributed
  group (``request`` is JSON: the trainer's address, the version, the server's URL, the backend,
  the timeout and the epoch; see :mod:`rollstream.engines.weight_transfer`). When the trainer no
  longer serves that version it answers ``{"served": false, "reason"}`` and touches nothing.

Callers may rely on:

* **Fenced.** A load whose epoch is older than the newest this worker accepted raises
  :class:`StaleEpochError` and touches nothing.
* **All or nothing.** Every parameter of the model (a tied output head aside) must be written by
  the load; a load that wrote fewer, or met a name or shape the model does not have, raises
  :class:`PartialLoadError` naming them. The weights may then be mixed, so the sync owner keeps the
  server's ``loading:`` label until a load succeeds.
* **Tied heads.** vLLM 0.32's in-place reload never loads the LM head of a model with tied word
  embeddings (Qwen2.5 0.5B-3B, our tiny models): the checkpoint holds no ``lm_head.weight``, and
  the head kept its OLD kernel form (on CPU a packed copy of the old embedding), so logprobs
  matched no checkpoint (up to 0.011 nats off). After every load the head is tied to the freshly
  loaded embedding again and its kernel form rebuilt (5e-7 after).

The load follows vLLM's own in-place reload (``reload_weights``) and its weight-transfer engines:
``initialize_layerwise_reload``, the model's ``load_weights``, ``finalize_layerwise_reload``;
it keeps the set of parameters ``load_weights`` reports, which ``reload_weights`` only logs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

from rollstream.engines.weight_transfer import NotServing, Receiver


class StaleEpochError(RuntimeError):
    """A load from a fencing epoch older than the newest one accepted."""


class PartialLoadError(RuntimeError):
    """A load that did not write every parameter of the model."""


class WeightLoader:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    model_runner: Any  # set by vLLM's worker
    rank: int  # the worker's rank (tensor parallel), set by vLLM's worker
    rollstream_fence: int = 0  # the newest fencing epoch a load came with

    def rollstream_ping(self) -> str:
        """Proof that the extension is installed (the weight fence's ``/rollstream/fence``)."""
        return "rollstream"

    def rollstream_load_weights(self, weights_path: str, epoch: str = "0") -> dict[str, Any]:
        """Load the checkpoint directory ``weights_path`` in place; what was done."""
        self._admit(int(epoch))
        from vllm.model_executor.model_loader import get_model_loader

        config = self.model_runner.vllm_config
        model_config = config.model_config
        model_config.model = weights_path  # as vLLM's reload_weights does for another directory
        model_config.model_weights = ""
        model_config.revision = None
        loader = get_model_loader(config.load_config)
        weights = loader.get_all_weights(model_config, self.model_runner.get_model())
        return self._reload(weights, f"checkpoint {weights_path}")

    def rollstream_receive_weights(self, request: str) -> dict[str, Any]:
        """Receive a version from the trainer over torch.distributed and load it in place."""
        spec = json.loads(request)
        self._admit(int(spec["epoch"]))
        workers = int(self.model_runner.vllm_config.parallel_config.world_size)
        receiver = Receiver(spec["address"], int(spec["version"]), spec["server"], worker=int(getattr(self, "rank", 0)),
                            workers=workers, backend=spec.get("backend", "gloo"),
                            timeout=float(spec.get("timeout", 60)), device=str(self.model_runner.device))
        try:
            manifest = receiver.join()
        except NotServing as exc:  # nothing touched: the sync owner catches up from a checkpoint
            receiver.close()
            return {"served": False, "reason": str(exc)}
        try:
            try:
                done = self._reload(receiver.tensors(manifest), f"v{manifest.version} from {spec['address']}")
            except Exception:
                receiver.acknowledge(False)  # the trainer hears of it now, not at its timeout
                raise
            receiver.acknowledge(True)
        finally:
            receiver.close()
        return {**done, "served": True, "bytes": receiver.received_bytes}

    def _admit(self, epoch: int) -> None:
        if epoch < self.rollstream_fence:
            raise StaleEpochError(f"load refused: fencing epoch {epoch} is older than {self.rollstream_fence}, "
                                  "the newest this server accepted")
        self.rollstream_fence = epoch

    def _reload(self, weights: Iterable[tuple[str, Any]], source: str) -> dict[str, Any]:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        started = time.perf_counter()
        model = self.model_runner.get_model()
        model_config = self.model_runner.vllm_config.model_config
        expected = {name for name, _ in model.named_parameters()}
        seen: list[str] = []
        initialize_layerwise_reload(model)
        try:
            loaded = set(model.load_weights(_recording(weights, seen)) or ())
        except Exception as exc:
            raise PartialLoadError(f"loading {source} failed after {len(seen)} tensors (last: "
                                   f"{seen[-1] if seen else None}): {type(exc).__name__}: {exc}"[:2000]) from None
        finally:
            finalize_layerwise_reload(model, model_config)  # old tensors back where nothing was loaded
            retie_word_embeddings(model)
            self.model_runner.reset_lora_state()
            self.model_runner.reset_encoder_cache()
            self.model_runner.reset_mm_cache()
        missing = sorted(expected - loaded - tied_parameters(model))
        if missing:
            raise PartialLoadError(f"loading {source} wrote {len(loaded)} of {len(expected)} parameters; not "
                                   f"written: {missing[:20]}")
        return {"loaded": len(loaded), "tensors": len(seen), "seconds": round(time.perf_counter() - started, 4)}


def _recording(weights: Iterable[tuple[str, Any]], seen: list[str]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        seen.append(name)
        yield name, tensor


def tied_parameters(model: Any) -> set[str]:
    """The output head's parameter names when the model ties it to the input embedding."""
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and getattr(model, "lm_head", None) is not None:
        return {f"lm_head.{name}" for name, _ in model.lm_head.named_parameters()}
    return set()


def retie_word_embeddings(model: Any) -> None:
    """Point the LM head at the input embedding again when the model ties them and the reload
    separated them."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False) or head is None or embed is None:
        return
    if head.weight is not embed.weight:
        head.weight = embed.weight
    # Shared or not, the head's kernel form was made from the old values (on CPU a packed copy
    # of the weight): make it again from the loaded embedding.
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)

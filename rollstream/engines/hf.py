"""A local transformers engine: continuous batching with a KV cache, interruptible per token.

Callers may rely on:

* Sampling follows SGLang's order: penalties (frequency penalty; stop tokens masked while fewer
  than ``min_new_tokens`` were generated), then temperature, then top-k, then top-p on the
  renormalised top-k. Greedy (``greedy=True`` or ``temperature <= 0``) takes the argmax.
* ``output_logprobs[i] = log_softmax(logits / T)[token]`` after penalties and before top-k/top-p
  filtering, as SGLang reports them. Greedy requests use ``T = 1.0`` for the logprob.
* Stopping: a token in ``stop_token_ids``, or the model's eos id unless ``ignore_eos``, ends the
  request with "stop" and is kept in the output (as in SGLang); so does a ``stop`` string in the
  decoded output. Reaching the budget ``gconfig.budget(prompt_len)`` ends it with "length",
  which (as in SGLang) wins over a stop token sampled as the last budgeted token.
* ``output_versions[i]`` is the engine version when token ``i`` was sampled. ``pause`` returns
  once the decode pass in flight has finished; requests keep their tokens and wait. ``update_weights``
  loads a checkpoint directory and sets the version; after ``resume`` every in-flight request's
  cache is recomputed with the new weights from the tokens it already has.
* With ``seed`` set, results are reproducible for the same sequence of requests and arrivals.
* A request is checked before it joins a decode pass (``rollstream.engines.request_check``): malformed
  ``input_ids``, ids outside the model's vocabulary, or a prompt that fills the model's context
  (``max_position_embeddings``) raise ``InvalidRequestError`` for that request alone; requests
  sharing its decode passes are untouched. The budget is also capped so prompt + output fit the context.
  AReaL's own ``ModelRequest`` and ``GenerationHyperparameters`` are accepted as they are; the
  response carries the request's ``tokenizer``, ``processor`` and ``image_data`` (``input_images``).
* Vision-language models (a Qwen2-VL-style directory: ``config.json`` with a ``vision_config``,
  and an image processor) load with ``AutoModelForImageTextToText``. A request's
  ``image_data`` (base64, data URIs or file paths, as SGLang takes them) is processed when it
  arrives and goes into the request's prefills (the first one, and the recomputation after a
  weight update), with multimodal rotary positions (``rollstream.engines.vision_rows``); its
  prompt must hold the image placeholder tokens the model's processor made for those images
  (``InvalidRequestError`` otherwise, and for ``image_data`` sent to a text-only model). Only
  placeholders in the prompt are image slots: a generated placeholder token is plain text.
  Logprobs equal a fresh forward pass with the same images (``rollstream.vision.forward``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from rollstream.api.engine import InferenceEngine, InvalidRequestError, WeightUpdate
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse, StopReason
from rollstream.engines.kv_batch import KVBatch, make_cache
from rollstream.engines.request_check import accepted_request, response_to
from rollstream.engines.sampling import SamplingSpec, sample
from rollstream.engines.vision_rows import EngineVision
from rollstream.runtime.tasks import cancel_and_wait
from rollstream.vision.forward import is_vision_model
from rollstream.vision.inputs import VisionInputs
from rollstream.vision.processor import load_image_processor

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SMALL_MODEL_PARAMS = 50_000_000

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass
class HFEngineStats:
    """Counters callers may read for throughput figures (never reset by the engine)."""

    tokens_generated: int = 0
    decode_passes: int = 0  # forward passes of the decoding batch, one token per row each


@dataclass
class _Seq:
    """One request in the engine. Mutated only on the event loop, read by the worker."""

    sid: int
    req: ModelRequest  # accepted: its input_ids are the prompt
    budget: int
    spec: SamplingSpec
    future: asyncio.Future[ModelResponse]
    started: float
    out_tokens: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    vision: VisionInputs | None = None  # the request's images (vision models only)
    rope_delta: int = 0  # next position = tokens so far + this (M-RoPE; 0 for text)


class HFEngine(InferenceEngine):
    """``InferenceEngine`` over a local ``AutoModelForCausalLM`` (see the module docstring).

    All torch work runs in one worker thread so the event loop stays responsive; a background
    task batches every active request (up to ``max_batch_size``) into one forward pass per token.
    ``num_threads`` sets torch's intra-op threads from the worker thread (torch applies it to
    threads started later too); by default a CPU model under 50M parameters uses 1 thread.
    Use the engine from one event loop.
    """

    def __init__(
        self, model_path: str, device: str = "cpu", dtype: str = "float32", max_batch_size: int = 32,
        seed: int | None = None, *, num_threads: int | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.max_batch_size = max_batch_size
        self.seed = seed
        self.num_threads = num_threads
        self.stats = HFEngineStats()
        self._version = 0
        self._model: Any = None
        self._tokenizer: Any = None
        self._eos_ids: frozenset[int] = frozenset()
        self._pad_id = 0
        self._vocab_size: int | None = None  # embedding rows: ids at or above are refused
        self._max_context: int | None = None
        self._fwd_kw: dict[str, str] = {}
        self._vision: EngineVision | None = None  # set when the model is a vision-language model
        self._executor: ThreadPoolExecutor | None = None
        self._generator: torch.Generator | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._pending: deque[_Seq] = deque()
        self._active: list[_Seq] = []
        self._kv = KVBatch()
        self._reset_cache = False
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._pass_lock = asyncio.Lock()
        self._start_lock = asyncio.Lock()

    # ----------------------------------------------------------------- lifecycle

    @property
    def tokenizer(self) -> Any:
        """The tokenizer saved with the model (``AutoTokenizer.from_pretrained(model_path)``)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    async def start(self) -> None:
        """Load the model (in the worker thread) and start the decoding loop. Idempotent."""
        async with self._start_lock:
            if self._loop_task is not None:
                return
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
            await self._in_worker(self._load_model)
            self._loop_task = asyncio.create_task(self._run(), name="hf-engine-loop")

    async def close(self) -> None:
        """Stop the loop and fail requests still waiting with ``RuntimeError``."""
        if self._loop_task is not None:
            await cancel_and_wait(self._loop_task)
            self._loop_task = None
        for seq in [*self._pending, *self._active]:
            if not seq.future.done():
                seq.future.set_exception(RuntimeError("HFEngine closed"))
        self._pending.clear()
        self._active.clear()
        self._kv, self._reset_cache = KVBatch(), False
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, True)
            self._executor = None

    def _load_model(self) -> None:
        model = _auto_model_class(self.model_path).from_pretrained(self.model_path)
        self._model = model.to(device=self.device, dtype=self.dtype).eval()
        # Intra-op threads do not pay off for tiny matrices, and spinning OpenMP threads on
        # shared cores made the tiny model 10-20x slower (measured on 2 busy cores).
        small = self.device.type == "cpu" and sum(p.numel() for p in model.parameters()) < _SMALL_MODEL_PARAMS
        threads = 1 if self.num_threads is None and small else self.num_threads
        if threads:
            torch.set_num_threads(threads)  # called in the worker thread; see the class docstring
        text_config = model.config.get_text_config()  # a VLM keeps these in its text config
        eos: set[int] = set()
        gen_config = getattr(model, "generation_config", None)
        for value in (getattr(text_config, "eos_token_id", None), getattr(gen_config, "eos_token_id", None)):
            if isinstance(value, int):
                eos.add(value)
            elif isinstance(value, (list, tuple)):
                eos.update(int(v) for v in value)
        self._eos_ids = frozenset(eos)
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        context = getattr(text_config, "max_position_embeddings", None)
        self._max_context = context if isinstance(context, int) and context > 0 else None
        pad = getattr(text_config, "pad_token_id", None)
        self._pad_id = pad if isinstance(pad, int) else min(self._eos_ids, default=0)
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values -> cache and num_logits_to_keep -> logits_to_keep.
        self._fwd_kw = {"cache": "cache" if "cache" in params else "past_key_values"}
        keep = [name for name in ("logits_to_keep", "num_logits_to_keep") if name in params]
        if keep:  # only the last position's logits are needed
            self._fwd_kw["keep"] = keep[0]
        if is_vision_model(model):
            self._vision = EngineVision(self._model, load_image_processor(self.model_path))
        self._generator = torch.Generator(device=self.device)
        if self.seed is not None:
            self._generator.manual_seed(self.seed)
        else:
            self._generator.seed()

    async def _in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    # ------------------------------------------------------------------- versions

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    async def pause(self) -> None:
        """Return once no decode pass is running; no new one starts until ``resume``."""
        self._unpaused.clear()
        async with self._pass_lock:
            pass

    async def resume(self) -> None:
        self._unpaused.set()

    async def update_weights(self, update: WeightUpdate) -> None:
        """Load ``update.path`` (safetensors files, else ``from_pretrained``) and set the version.

        Runs between decode passes even when not paused. Raises ``ValueError`` (weights unchanged) when
        the checkpoint's parameter names or shapes do not match the model.
        """
        await self.start()
        async with self._pass_lock:
            await self._in_worker(self._load_weights, update.path)
            self._version = update.version
            self._reset_cache = True  # cached keys/values came from the old weights
        logger.info("HFEngine loaded weights version %d from %s", update.version, update.path)

    def _load_weights(self, path: str) -> None:
        files = sorted(Path(path).glob("*.safetensors"))
        state = self._read_safetensors(files) if files else None
        if state is None:
            # No safetensors, or saved under the hub's names (transformers renames some
            # models' parameters on save, e.g. Qwen2-VL's): let transformers map them back.
            state = _auto_model_class(path).from_pretrained(path).state_dict()
        self._check_state(state)
        with torch.no_grad():
            self._model.load_state_dict(state, strict=False)

    def _read_safetensors(self, files: list[Path]) -> dict[str, torch.Tensor] | None:
        """The tensors of ``files``; None when their names are not the model's and a
        ``config.json`` beside them lets transformers load them instead."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        names: set[str] = set()
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                names.update(handle.keys())
        if not names <= set(self._model.state_dict()) and (files[0].parent / "config.json").is_file():
            return None
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state

    def _check_state(self, state: dict[str, torch.Tensor]) -> None:
        """Validate before loading, so a bad checkpoint leaves the model untouched."""
        expected = self._model.state_dict()
        unexpected = sorted(set(state) - set(expected))
        wrong = sorted(k for k in state if k in expected and state[k].shape != expected[k].shape)
        # Tied parameters (lm_head = embeddings) are saved under one name only.
        names_by_tensor: dict[int, set[str]] = {}
        for name, param in self._model.named_parameters(remove_duplicate=False):
            names_by_tensor.setdefault(id(param), set()).add(name)
        covered = {n for names in names_by_tensor.values() if names & set(state) for n in names}
        missing = sorted(set(expected) - set(state) - covered)
        if unexpected or wrong or missing:
            raise ValueError(
                f"checkpoint does not match the model: unexpected={unexpected[:5]} "
                f"wrong_shape={wrong[:5]} missing={missing[:5]}"
            )

    # ----------------------------------------------------------------- generation

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for ``req`` (see the module docstring). Raises ``InvalidRequestError`` (a
        ``ValueError``) for a malformed request and ``ValueError`` when no budget is left."""
        await self.start()
        req = accepted_request(req, vocab_size=self._vocab_size, max_context=self._max_context)
        prompt = req.input_ids
        if self._vision is None and req.image_data:
            raise InvalidRequestError(
                f"the request has {len(req.image_data)} image_data entries but {self.model_path} is a "
                "text-only model; send images to a vision-language model")
        vision = None if self._vision is None else await self._in_worker(self._vision.prepare, prompt, req.image_data)
        budget = req.gconfig.budget(len(prompt))
        if self._max_context is not None:
            budget = min(budget, self._max_context - len(prompt))
        seq = _Seq(next(self._ids), req, budget, self._spec(req.gconfig), asyncio.get_running_loop().create_future(),
                   time.monotonic(), vision=vision)
        self._pending.append(seq)
        self._wake.set()
        return await seq.future

    def _spec(self, g: GenerationHyperparameters) -> SamplingSpec:
        stop_ids = set(g.stop_token_ids)
        if not g.ignore_eos:
            stop_ids |= self._eos_ids
        greedy = g.greedy or g.temperature <= 0
        return SamplingSpec(
            greedy=greedy,
            temperature=1.0 if greedy else float(g.temperature),
            top_k=int(g.top_k),
            top_p=float(g.top_p),
            min_new_tokens=g.min_new_tokens,
            stop_ids=frozenset(stop_ids),
            stop_strings=tuple(s for s in (g.stop or []) if s),
            frequency_penalty=float(g.frequency_penalty),
        )

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await self._unpaused.wait()
            async with self._pass_lock:
                if not self._unpaused.is_set():
                    continue  # paused while we waited for the lock
                self._admit()
                if not self._active:
                    self._wake.clear()
                    continue
                await self._decode_pass()

    def _admit(self) -> None:
        self._active = [s for s in self._active if not s.future.done()]  # dropped by callers
        while self._pending and len(self._active) < self.max_batch_size:
            seq = self._pending.popleft()
            if not seq.future.done():
                self._active.append(seq)

    async def _decode_pass(self) -> None:
        reset, self._reset_cache = self._reset_cache, False
        version = self._version  # no weight update can run during the pass (pass lock)
        seqs = list(self._active)
        try:
            results = await self._in_worker(self._compute_pass, seqs, reset)
            self._apply(seqs, results, version)
        except Exception as exc:  # fail this batch, keep the engine alive for new requests
            logger.exception("HFEngine decode pass failed; failing %d requests", len(seqs))
            for seq in seqs:
                if not seq.future.done():
                    seq.future.set_exception(exc)
            self._active.clear()
            self._reset_cache = True

    def _apply(self, seqs: list[_Seq], results: dict[int, tuple[int, float]], version: int) -> None:
        now = time.monotonic()
        for seq in seqs:
            if seq.future.done():
                continue
            token, logprob = results[seq.sid]
            seq.out_tokens.append(token)
            seq.out_logprobs.append(logprob)
            seq.out_versions.append(version)
            seq.first_token_at = seq.first_token_at or now
            self.stats.tokens_generated += 1
            reason = self._finish_reason(seq)
            if reason is not None:
                seq.future.set_result(response_to(seq.req, seq.out_tokens, seq.out_logprobs, seq.out_versions, reason,
                                                  now - seq.started, (seq.first_token_at or now) - seq.started))
        self._active = [s for s in self._active if not s.future.done()]

    def _finish_reason(self, seq: _Seq) -> StopReason | None:
        n = len(seq.out_tokens)
        if n >= seq.budget:
            return "length"
        if n < seq.spec.min_new_tokens:
            return None
        if seq.out_tokens[-1] in seq.spec.stop_ids:
            return "stop"
        if not seq.spec.stop_strings:
            return None
        # A token decodes to at least one byte, so this tail covers any stop string.
        text = self.tokenizer.decode(seq.out_tokens[-(4 * max(len(s) for s in seq.spec.stop_strings) + 2):])
        return "stop" if any(s in text for s in seq.spec.stop_strings) else None

    # ------------------------------------------------------- worker-thread torch

    @torch.no_grad()
    def _compute_pass(self, seqs: list[_Seq], reset: bool) -> dict[int, tuple[int, float]]:
        """One token for every row: decode the cached rows, prefill the new ones, sample."""
        if reset:
            self._kv = KVBatch()
        kv = self._kv
        by_id = {s.sid: s for s in seqs}
        kv.keep(set(by_id))
        old = set(kv.rows)
        parts = []
        if kv.rows:
            parts.append(self._decode(kv, [by_id[sid] for sid in kv.rows]))
        new = [s for s in seqs if s.sid not in old]
        if new:
            parts.append(self._prefill(kv, new))
        logits = torch.cat(parts).float()
        rows = [by_id[sid] for sid in kv.rows]
        tokens, logprobs = sample(logits, [s.spec for s in rows], [s.out_tokens for s in rows], self._generator)
        self.stats.decode_passes += 1
        return {s.sid: (t, lp) for s, t, lp in zip(rows, tokens, logprobs)}

    def _forward(
        self, ids: torch.Tensor | None, mask: torch.Tensor, pos: torch.Tensor, cache: Any, embeds: torch.Tensor | None = None,
    ) -> Any:
        kwargs: dict[str, Any] = {self._fwd_kw["cache"]: cache}
        if "keep" in self._fwd_kw:
            kwargs[self._fwd_kw["keep"]] = 1
        tokens = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
        return self._model(**tokens, attention_mask=mask, position_ids=pos, use_cache=True, **kwargs)

    @staticmethod
    def _out_cache(out: Any) -> Any:
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values

    def _decode(self, kv: KVBatch, seqs: list[_Seq]) -> torch.Tensor:
        assert kv.mask is not None
        ids = torch.tensor([s.out_tokens[-1] for s in seqs], device=self.device).unsqueeze(1)
        pos = kv.mask.sum(-1, keepdim=True)  # real tokens so far = position of the new one
        if self._vision is not None:
            pos = self._vision.decode_positions(pos, [s.rope_delta for s in seqs])
        mask = torch.cat([kv.mask, kv.mask.new_ones(len(seqs), 1)], dim=1)
        out = self._forward(ids, mask, pos, kv.cache)
        kv.cache, kv.mask = self._out_cache(out), mask
        return out.logits[:, -1]

    def _prefill(self, kv: KVBatch, seqs: list[_Seq]) -> torch.Tensor:
        seq_tokens = [s.req.input_ids + s.out_tokens for s in seqs]
        length = max(len(t) for t in seq_tokens)
        ids = torch.full((len(seqs), length), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for i, toks in enumerate(seq_tokens):
            ids[i, length - len(toks):] = torch.tensor(toks)
            mask[i, length - len(toks):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        if self._vision is None:
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            out = self._forward(ids, mask, pos, make_cache())
        else:
            spans = [(length - len(t), length - len(t) + len(s.req.input_ids)) for s, t in zip(seqs, seq_tokens)]
            embeds, pos, deltas = self._vision.prefill(ids, mask, spans, [s.vision for s in seqs])
            for seq, delta in zip(seqs, deltas.tolist()):
                seq.rope_delta = int(delta)
            out = self._forward(None, mask, pos, make_cache(), embeds)
        kv.extend([s.sid for s in seqs], self._out_cache(out), mask)
        return out.logits[:, -1]


def _auto_model_class(path: str) -> Any:
    """``AutoModelForImageTextToText`` for a vision-language model directory, else
    ``AutoModelForCausalLM``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM

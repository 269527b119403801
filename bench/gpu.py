"""GPU benchmark: HFEngine generation through the pipeline against the same generation called
directly, tokens/s — the pipeline's overhead where a real model sets the pace.

Direct: one ``HFEngine`` (as the rollout worker builds it: ``HFEngine(model_path, device,
seed)``, float32) serves ``prompts`` groups of ``group_size`` requests, at most
``--max-concurrent-rollouts`` at once. Pipeline: the real tiers, each in its own process, the rollout worker with
``rollout.engine: hf`` on the same model and device, read by a ``BatchStream``. Both generate
exactly ``--max-new-tokens`` per request (``ignore_eos``), and both rates count the generated tokens over the window from the first
completed group to the last (start-up excluded), so tokens/s compare directly.

The model comes from a local directory (``--model-path``, a Hugging Face model directory with
its tokenizer); nothing is downloaded. Needs CUDA unless ``--device cpu``; ``--quick`` builds
the project's tiny offline model and runs on CPU (a smoke run, not a measurement).

    python -m bench.gpu --model-path /models/Qwen2.5-0.5B-Instruct --device cuda
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Report, base_parser
from bench.pipeline_run import PipelineSettings, run_pipeline
from bench.stack import services, tokenizer_path
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest
from rollstream.engines.hf import HFEngine


class SetupError(RuntimeError):
    """The machine or the arguments cannot run this benchmark (message says what to do)."""


def check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SetupError(
            f"--device {device}: CUDA is not available on this machine (torch {torch.__version__}, "
            f"cuda build {torch.version.cuda}). Run bench/gpu.py on a GPU machine, or pass "
            "--device cpu (as --quick does) to check that it works."
        )


def check_model(path: str) -> None:
    model = Path(path)
    if not (model / "config.json").is_file():
        raise SetupError(f"--model-path {path}: not a local model directory (no config.json); nothing is downloaded")


def vocab_size(path: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).vocab_size)


async def direct(model: str, device: str, prompts: int, group_size: int, prompt_tokens: int, new_tokens: int,
                 concurrency: int, vocab: int) -> dict[str, float]:
    """Groups of ``group_size`` requests on one engine; rate over the window from the first
    group's completion to the last's (the estimator the pipeline uses for its batches)."""
    engine = HFEngine(model, device=device, seed=0)
    await engine.start()
    gconfig = GenerationHyperparameters(max_new_tokens=new_tokens, max_tokens=prompt_tokens + new_tokens + 1,
                                        ignore_eos=True)
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        ids = [(i * 7 + j) % vocab for j in range(prompt_tokens)]
        async with slots:
            resp = await engine.agenerate(ModelRequest(input_ids=ids, gconfig=gconfig.new()))
        return resp.output_len

    async def group(i: int) -> tuple[float, int]:
        tokens = sum(await asyncio.gather(*(one(i) for _ in range(group_size))))
        return time.monotonic(), tokens

    try:
        await one(0)  # warm-up: kernels, caches
        done = sorted(await asyncio.gather(*(group(i) for i in range(prompts))))
    finally:
        await engine.close()
    tokens = sum(t for _, t in done)
    window = done[-1][0] - done[0][0]
    return {"path": "HFEngine called directly", "requests": prompts * group_size, "generated tokens": tokens,
            "seconds": window, "tokens/s": tokens * (prompts - 1) / prompts / window if window > 0 else float("nan")}


async def through_pipeline(model: str, device: str, prompts: int, group_size: int, prompt_tokens: int,
                           new_tokens: int, concurrency: int, vocab: int, confirm: bool) -> dict[str, float]:
    settings = PipelineSettings(
        prompts=prompts, group_size=group_size, prompt_tokens=prompt_tokens, completion_tokens=new_tokens,
        max_concurrent_rollouts=concurrency, load_engine=False, vocab_size=vocab, tokenizer=model, timeout_s=540,
        confirm_ready=confirm,
        rollout={"engine": "hf", "model_path": model, "tokenizer_path": model, "device": device, "seed": 0,
                 "gconfig": {"max_new_tokens": new_tokens, "max_tokens": prompt_tokens + new_tokens + 1,
                             "ignore_eos": True}},
    )
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp, services(Path(tmp)) as dev:
        r = await run_pipeline(dev.services, Path(tmp) / "pipeline", settings)
    return {"path": "HFEngine through the pipeline (steady window)", "requests": r.episodes,
            "generated tokens": r.generated_tokens, "seconds": r.steady_seconds,
            "tokens/s": r.rate(r.generated_tokens)}


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("gpu", __doc__.splitlines()[0])
    parser.add_argument("--model-path", help="local Hugging Face model directory (required unless --quick)")
    parser.add_argument("--device", default=None, help="cuda (default), cuda:N, or cpu (default with --quick)")
    parser.add_argument("--prompts", type=int, default=None, help="groups (default 32; --quick 2)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 512; --quick 16")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 512; --quick 8")
    parser.add_argument("--max-concurrent-rollouts", type=int, default=32, help="= HFEngine's max batch size")
    args = parser.parse_args(argv)
    device = args.device or ("cpu" if args.quick else "cuda")
    prompts = args.prompts or (2 if args.quick else 32)
    prompt_tokens = args.prompt_tokens or (16 if args.quick else 512)
    new_tokens = args.max_new_tokens or (8 if args.quick else 512)
    try:
        check_device(device)
        if args.model_path is None and not args.quick:
            raise SetupError("--model-path is required (a local model directory); --quick uses the tiny offline model")
        model = args.model_path or str(tokenizer_path())
        check_model(model)
    except SetupError as exc:
        print(f"bench.gpu: {exc}", file=sys.stderr)
        return 2
    report = Report("gpu", args.quick)
    vocab = vocab_size(model)
    rows = [asyncio.run(direct(model, device, prompts, args.group_size, prompt_tokens, new_tokens,
                               args.max_concurrent_rollouts, vocab))]
    rows.append(asyncio.run(through_pipeline(model, device, prompts, args.group_size, prompt_tokens, new_tokens,
                                             args.max_concurrent_rollouts, vocab, confirm=not args.quick)))
    rows[1]["% of direct"] = 100 * rows[1]["tokens/s"] / rows[0]["tokens/s"]
    report.table(f"HFEngine on {device} ({model}): {prompts} prompts x {args.group_size}, "
                 f"{prompt_tokens} prompt + {new_tokens} new tokens", rows)
    report.extra.update(model=model, device=device, gpu=torch.cuda.get_device_name(0) if device.startswith("cuda") else None)
    report.note("the pipeline's share of direct generation: the rest is what rollstream costs where a model sets the pace")
    return report.finish(args.out)


if __name__ == "__main__":
    sys.exit(main())

"""Inference-server benchmark: generation through the whole pipeline against the same engine
driven directly, tokens/s, where a real model sets the pace.

``--engine vllm`` (default): a real vLLM server (``--server-url``, e.g. a GPU server, or one this
script starts on ``--model-path`` with ``rollstream.dev.vllm_server``: CPU, float32). Direct: a
``VLLMEngine`` on that server (the rollout worker's client, so the requests are the same) serves
``--prompts`` groups of ``--group-size`` requests, at most ``--concurrency`` in flight. Pipeline:
the real tiers, each in its own process, the rollout worker with ``rollout.engine: vllm`` and
``max_concurrent_rollouts`` = the same concurrency, on the same server, read by a
``StepStream``. ``--engine hf``: the same comparison with ``HFEngine`` (in this process, and in
the rollout worker) on ``--device`` (cuda by default: the GPU check of the local engine).

Both paths generate from the same prompts with the same settings, those the rollout worker's
RLVR workflow sends (``--max-new-tokens``, ``ignore_eos``, and the tokenizer's eos and pad ids as
stop tokens, so a request may end early), and both rates count the generated tokens over the
window from the first completed group to the last (start-up excluded). The two paths alternate twice (direct, pipeline, direct,
pipeline) and the better run of each counts: the machine is shared and a server warms up. Each
run is sized to last ``--window`` seconds (60; a short direct run measures the rate first, and
``--prompts`` overrides it) at ``--concurrency`` requests in flight, by default twice the local
server's batch (``--server-max-seqs``, 8), so the server is never short of work. The table gives
every run's rate, each path's spread between runs and the spread of the per-round ratio.
Target (vLLM): the pipeline >= 95% of direct.

    python -m bench.server                                   # CPU: a local vLLM server on the tiny model
    python -m bench.server --server-url http://gpu0:8000 --model-path /models/Qwen2.5-0.5B-Instruct
    python -m bench.server --engine hf --model-path DIR --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from bench.common import Report, base_parser
from bench.pipeline_run import PipelineSettings, run_pipeline
from harness.services import services, tokenizer_path
from rollstream.api.engine import InferenceEngine
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest


TARGET = 0.95  # the pipeline's share of direct generation on the same server (vLLM)


class SetupError(RuntimeError):
    """The machine or the arguments cannot run this benchmark (message says what to do)."""


def check_model(path: str) -> None:
    if not (Path(path) / "config.json").is_file():
        raise SetupError(f"--model-path {path}: not a local model directory (no config.json); nothing is downloaded")


def check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SetupError(
            f"--device {device}: CUDA is not available on this machine (torch {torch.__version__}, "
            f"cuda build {torch.version.cuda}). Run it on a GPU machine, or pass --device cpu.")


def vocab_size(path: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).vocab_size)


def make_engine(args: argparse.Namespace, url: str | None) -> InferenceEngine:
    if args.engine == "vllm":
        from rollstream.engines.vllm import VLLMEngine

        assert url is not None
        return VLLMEngine([url], args.model_path)
    from rollstream.engines.hf import HFEngine

    return HFEngine(args.model_path, device=args.device, seed=0)


def prompt_ids(i: int, tokens: int, vocab: int) -> list[int]:
    return [(i * 7 + j) % vocab for j in range(tokens)]


async def direct(args: argparse.Namespace, url: str | None, vocab: int) -> dict[str, Any]:
    """Groups of ``group_size`` requests on one engine, ``concurrency`` in flight; the rate over
    the window from the first group's completion to the last's (as for the pipeline's batches)."""
    from transformers import AutoTokenizer

    engine = make_engine(args, url)
    await engine.start()
    gconfig = GenerationHyperparameters(max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                        max_tokens=args.prompt_tokens + args.max_new_tokens + 1)
    gconfig = gconfig.new_with_stop_and_pad_token_ids(AutoTokenizer.from_pretrained(args.model_path))  # as a workflow
    slots = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> int:
        async with slots:
            resp = await engine.agenerate(ModelRequest(input_ids=prompt_ids(i, args.prompt_tokens, vocab),
                                                       gconfig=gconfig.new()))
        return resp.output_len

    async def group(i: int) -> tuple[float, int]:
        tokens = sum(await asyncio.gather(*(one(i) for _ in range(args.group_size))))
        return time.monotonic(), tokens

    try:
        await one(0)  # warm-up
        done = sorted(await asyncio.gather(*(group(i) for i in range(args.prompts))))
    finally:
        await engine.close()
    tokens = sum(t for _, t in done)
    window = done[-1][0] - done[0][0]
    rate = tokens * (args.prompts - 1) / args.prompts / window if window > 0 else float("nan")
    return {"path": "directly", "requests": args.prompts * args.group_size, "generated tokens": tokens,
            "seconds": round(window, 2), "tokens/s": rate}


async def through_pipeline(args: argparse.Namespace, url: str | None, vocab: int) -> dict[str, Any]:
    rollout: dict[str, Any] = {
        "model_path": args.model_path, "tokenizer_path": args.model_path,
        "gconfig": {"max_new_tokens": args.max_new_tokens, "ignore_eos": True,
                    "max_tokens": args.prompt_tokens + args.max_new_tokens + 1},
    }
    if args.engine == "vllm":
        rollout.update(engine="vllm", server_urls=[url])
    else:
        rollout.update(engine="hf", device=args.device, seed=0)
    settings = PipelineSettings(
        prompts=args.prompts, group_size=args.group_size, prompt_tokens=args.prompt_tokens,
        completion_tokens=args.max_new_tokens, max_concurrent_rollouts=args.concurrency, load_engine=False,
        vocab_size=vocab, tokenizer=args.model_path, timeout_s=900, confirm_ready=not args.quick, rollout=rollout,
    )
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp, services(Path(tmp)) as dev:
        r = await run_pipeline(dev.services, Path(tmp) / "pipeline", settings)
    return {"path": "through the pipeline", "requests": r.episodes, "generated tokens": r.generated_tokens,
            "seconds": round(r.steady_seconds, 2), "tokens/s": r.rate(r.generated_tokens)}


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[str | None]:
    """The vLLM server's URL: ``--server-url``, or a local one started here and stopped after."""
    if args.engine != "vllm" or args.server_url:
        yield args.server_url
        return
    from rollstream.config import ServerLaunchConfig
    from rollstream.dev.vllm_server import LocalVLLMServer

    with tempfile.TemporaryDirectory(prefix="rollstream-bench-vllm-") as tmp:
        launch = ServerLaunchConfig(max_num_seqs=args.server_max_seqs,
                                    max_model_len=args.prompt_tokens + args.max_new_tokens + 8)
        local = LocalVLLMServer(Path(tmp), args.model_path, launch, cpus=args.server_cpus, confine=True)
        local.start()
        print(f"bench.server: vLLM ready in {local.startup_seconds:.0f}s at {local.url}", file=sys.stderr)
        try:
            yield local.url
        finally:
            local.stop()


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--server-url", default=None, help="a running vLLM server (default: start one locally)")
    parser.add_argument("--model-path", default=None,
                        help="local model directory (the server's model with --server-url; default: the tiny model)")
    parser.add_argument("--device", default="cuda", help="--engine hf: cuda (default), cuda:N or cpu")
    parser.add_argument("--prompts", type=int, default=None, help="groups (default: as many as --window takes; --quick 2)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 64; --quick 8")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 128; --quick 8")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="requests in flight (rollout.max_concurrent_rollouts; default 2 x --server-max-seqs: "
                             "the server never waits for work)")
    parser.add_argument("--server-max-seqs", type=int, default=8, help="the local server's batch (max_num_seqs, default 8)")
    parser.add_argument("--window", type=float, default=None,
                        help="seconds each run lasts (default 60; --quick: --prompts 2 instead); sizes --prompts")
    parser.add_argument("--rounds", type=int, default=None, help="direct/pipeline pairs (default 2; --quick 1)")
    parser.add_argument("--server-cpus", default="",
                        help="the local server's cores, e.g. 0 (all its processes: the API server, the engine core and "
                             "the model's threads); this process, the tiers and the broker then run on the other cores, "
                             "as a GPU server leaves the CPUs to the pipeline (default: every process shares every core)")


def pin_away_from(cpus: str) -> set[int]:
    """Run this process (and so the tiers and the broker it starts) off the server's cores."""
    taken: set[int] = set()
    for part in cpus.split(","):
        low, _, high = part.partition("-")
        taken |= set(range(int(low), int(high or low) + 1))
    rest = os.sched_getaffinity(0) - taken
    if not rest:
        raise SetupError(f"--server-cpus {cpus} leaves no core for the pipeline")
    os.sched_setaffinity(0, rest)
    return rest


async def measure(args: argparse.Namespace, report: Report) -> None:
    vocab = vocab_size(args.model_path)
    paths: list[tuple[str, Callable[..., Awaitable[dict[str, Any]]]]] = [("directly", direct),
                                                                          ("through the pipeline", through_pipeline)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in paths}
    with server(args) as url:
        if args.server_cpus:
            report.extra["pipeline cpus"] = sorted(pin_away_from(args.server_cpus))
        if not args.prompts:
            args.prompts = await sized_prompts(args, url, vocab)
        for _ in range(args.rounds):
            for name, run in paths:
                runs[name].append(await run(args, url, vocab))
    rows = [max(runs[name], key=lambda r: r["tokens/s"]) | spread(runs[name]) for name, _ in paths]
    share = rows[1]["tokens/s"] / rows[0]["tokens/s"]
    rows[1]["% of direct"] = 100 * share
    ratios = [p["tokens/s"] / d["tokens/s"] for d, p in zip(runs["directly"], runs["through the pipeline"])]
    rows[1]["% of direct per round"] = [round(100 * r, 1) for r in ratios]
    where = args.server_url or ("a local vLLM server (CPU)" if args.engine == "vllm" else args.device)
    report.table(f"{args.engine} on {where} ({args.model_path}): {args.prompts} prompts x {args.group_size}, "
                 f"{args.prompt_tokens} prompt + {args.max_new_tokens} new tokens, {args.concurrency} in flight", rows)
    report.extra.update(engine=args.engine, model=args.model_path, server=where)
    if args.engine == "vllm":
        report.target("pipeline tokens/s / direct tokens/s on the same vLLM server", share, TARGET)


async def sized_prompts(args: argparse.Namespace, url: str | None, vocab: int) -> int:
    """Groups that keep a run busy for ``--window`` seconds at the rate a short direct run measures."""
    trial = argparse.Namespace(**{**vars(args), "prompts": max(3, 2 * args.concurrency // args.group_size)})
    measured = await direct(trial, url, vocab)
    rate = measured["tokens/s"]
    per_group = args.group_size * measured["generated tokens"] / measured["requests"]  # a request may end early
    # the window opens when the first groups complete (the groups in flight then are not in it),
    # and a short run's rate is below a long one's (measured: 10% below): sized 25% over
    prompts = max(3, math.ceil(1.25 * args.window * rate / per_group) + math.ceil(args.concurrency / args.group_size) + 1)
    print(f"bench.server: {rate:.0f} tokens/s directly: {prompts} groups for a {args.window:.0f} s window",
          file=sys.stderr)
    return prompts


def spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run's rate, and how far apart they are: (max - min) / max."""
    rates = [r["tokens/s"] for r in runs]
    return {"runs": [round(r, 1) for r in rates], "spread %": round(100 * (max(rates) - min(rates)) / max(rates), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("server", __doc__.splitlines()[0])
    arguments(parser)
    args = parser.parse_args(argv)
    args.concurrency = args.concurrency or 2 * args.server_max_seqs
    args.window = args.window if args.window is not None else (0.0 if args.quick else 60.0)
    args.prompts = args.prompts or (2 if args.quick or not args.window else 0)  # 0: sized to the window
    args.prompt_tokens = args.prompt_tokens or (8 if args.quick else 64)
    args.max_new_tokens = args.max_new_tokens or (8 if args.quick else 128)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.model_path = args.model_path or str(tokenizer_path())
    try:
        check_model(args.model_path)
        if args.engine == "hf":
            check_device(args.device)
    except SetupError as exc:
        print(f"bench.server: {exc}", file=sys.stderr)
        return 2
    report = Report("server", args.quick)
    asyncio.run(measure(args, report))
    return report.finish(args.out)


if __name__ == "__main__":
    sys.exit(main())

"""Weight updates on a real vLLM server: what each version costs the trainer, how long the server
pauses, the bytes moved, and generation across updates, for each way a version can reach a
server (``rollout.weight_transfer``: checkpoint, distributed) and each way a server treats its
running requests (``rollout.weight_update_mode``: abort, keep), side by side with no updates.

The rollout side is a rollout worker's own pieces (a ``VLLMEngine`` and the sync owner of
its ``SharedServerFollower``, following Redis); the trainer side is ``VersionPublisher`` with a
model in hand, publishing a new version every ``--interval`` seconds (or as soon as the last
publish returned, when it took longer). ``--lanes`` requests of ``--new-tokens`` tokens (eos
ignored) generate all the time; generation is counted by the server itself (``/metrics``:
generated tokens over the window), and so are the tokens it prefilled again (prompt tokens
beyond the fresh requests' prompts: what abort costs).

The columns:

* trainer s: from the end of a step until ``publish`` returned: checkpoint = ``save_pretrained``
  + publish (the server loads afterwards), distributed = the send, waited for until the server
  took it;
* pause s: the server's pause, from the owner's "pausing" to its "continuing" record (Redis);
* MiB: the bytes of one version (the checkpoint, or what went over the wire);
* tokens/s and % of no updates; re-prefilled: tokens prefilled again per update.

The modes run in turn, ``--rounds`` times (the machine's load moves between runs); each mode's
best round counts, its rounds listed beside it.

    python -m bench.weights                              # the tiny model, a local server
    python -m bench.weights --model random --params 0.5  # a random Qwen2 body of >= 0.5B parameters
    python -m bench.weights --quick                      # a smoke run (the suite)

Target: keep >= 90% of no updates' tokens/s (each transfer). All modes run on one server started
with ``--no-enable-prefix-caching`` (keep needs it; the lanes' prompts differ, so no mode gains
from prefix caching).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import torch

from bench.common import Report, base_parser, mean, percentiles
from harness.checkpoints import fresh_server
from harness.vllm_requests import Lanes
from rollstream.config import RollstreamConfig, ServerLaunchConfig, config_from_dict
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest
from rollstream.engines.vllm import VLLMEngine
from rollstream.rollout_workers.weight_sync import SharedServerFollower, WeightSync
from rollstream.state.client import RedisKeys
from rollstream.state.server_lease import ServerLeases, ServerSyncState
from rollstream.state.version_store import VersionStore
from rollstream.trainer import Checkpoints, VersionPublisher

TARGET = 0.90  # keep's tokens/s against no updates
MODES = (("no updates", "", "abort"), ("checkpoint, abort", "checkpoint", "abort"),
         ("checkpoint, keep", "checkpoint", "keep"), ("distributed, abort", "distributed", "abort"),
         ("distributed, keep", "distributed", "keep"))
PROMPT_TOKENS = 16


def random_model(params_billions: float, out: Path) -> Path:
    """A Qwen2-shaped model of random weights with at least ``params_billions`` parameters (the
    tiny model's tokenizer and vocabulary: the body is what costs), built once and cached."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollstream.testing.tiny import tiny_model_dir

    tiny = Path(tiny_model_dir())
    config = AutoConfig.from_pretrained(tiny)
    config.hidden_size, config.intermediate_size = 1024, 4096
    config.num_attention_heads, config.num_key_value_heads = 16, 4
    per_layer = 2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 4096  # attention (q, o; k, v a quarter) + MLP
    config.num_hidden_layers = int(params_billions * 1e9 // per_layer) + 1
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    path = out / f"random-qwen2-{config.num_hidden_layers}x1024"
    if not (path / "config.json").exists():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tiny / name, path / name)
    return path


def parameters(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


@contextlib.contextmanager
def local_services(args: argparse.Namespace, model: Path, work: Path) -> Iterator[tuple[str, str]]:
    """(vLLM URL, Redis URL): started here unless given."""
    from rollstream.dev.redis_server import LocalRedisServer
    from rollstream.dev.vllm_server import LocalVLLMServer

    with contextlib.ExitStack() as stack:
        redis_url = args.redis_url
        if not redis_url:
            redis = LocalRedisServer(work / "redis")
            redis_url = redis.start()
            stack.callback(redis.stop)
        url = args.server_url
        if not url:
            launch = ServerLaunchConfig(max_model_len=PROMPT_TOKENS + args.new_tokens + 16,
                                        max_num_seqs=max(8, args.lanes), cuda_graphs=False, prefix_caching=False)
            server = LocalVLLMServer(work / "vllm", model, launch, cpus=args.server_cpus,
                                     confine=bool(args.server_cpus))
            url = server.start()
            stack.callback(server.stop)
            print(f"bench.weights: vLLM ready in {server.startup_seconds:.0f}s at {url}", file=sys.stderr)
        yield url, redis_url


def config_for(url: str, redis_url: str, model: Path, name: str, transfer: str, mode: str) -> RollstreamConfig:
    return config_from_dict({
        "redis": {"url": redis_url},
        "experiment": {"experiment_name": name, "trial_name": "t0"},
        "rollout": {"engine": "vllm", "server_urls": [url], "model_path": str(model),
                    "weight_transfer": transfer or "checkpoint", "weight_update_mode": mode,
                    "server": {"reconcile_seconds": 1.0, "version_poll_seconds": 0.05, "lease_ttl_seconds": 10.0}},
        "trainer": {"keep_checkpoints": 2, "weight_sender": {"timeout_seconds": 120}},
    })


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
               or line.startswith(name + " "))


def lanes_of(engine: VLLMEngine, lanes: int, new_tokens: int, vocab: int) -> Lanes:
    """``lanes`` requests generating all the time, each with a prompt of its own."""
    def request(lane: int, n: int) -> ModelRequest:
        ids = [(lane * 7919 + n * 104729 + k * 31) % (vocab - 4) + 3 for k in range(PROMPT_TOKENS)]
        return ModelRequest(input_ids=ids, gconfig=GenerationHyperparameters(max_new_tokens=new_tokens, ignore_eos=True))

    return Lanes(engine, lanes, request)


@contextlib.asynccontextmanager
async def rollout_side(config: RollstreamConfig, redis: aioredis.Redis) -> AsyncIterator[VLLMEngine]:
    rollout = config.rollout
    engine = VLLMEngine(rollout.server_urls, rollout.model_path, rollout.server, rollout.weight_update_mode)
    keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
    store = VersionStore(redis, keys)
    leases = ServerLeases(redis, keys, "bench-worker", rollout.server.lease_ttl_seconds)
    sync = WeightSync(rollout.server_urls, engine.admin, leases, rollout.server, rollout.weight_update_mode,
                      store.latest_checkpoint)
    follower = SharedServerFollower(engine, store, sync, poll_seconds=0.5)
    await engine.start()
    await follower.catch_up()
    task = asyncio.create_task(follower.run())
    try:
        yield engine
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.close()


async def pauses(redis: aioredis.Redis, config: RollstreamConfig, out: list[float]) -> None:
    """The server's pauses, from the owner's records (pausing -> continuing)."""
    keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
    pubsub = redis.pubsub()
    await pubsub.subscribe(ServerLeases(redis, keys, "bench-reader", 10.0).channel)
    started: float | None = None
    try:
        async for message in pubsub.listen():
            if message["type"] != "message":
                continue
            state = json.loads(message["data"])
            phase = ServerSyncState(**state).phase
            if phase == "pausing":
                started = state["since"]
            elif phase == "continuing" and started is not None:
                out.append(state["since"] - started)
                started = None
    finally:
        await pubsub.aclose()


def save(checkpoints: Checkpoints, version: int, model: Any) -> None:
    with checkpoints.write(version) as out:
        model.save_pretrained(out)


def nudge(model: Any, version: int) -> None:
    """A training step's change to the weights (not timed)."""
    generator = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 1e-3)


async def one_mode(args: argparse.Namespace, url: str, redis_url: str, model_path: Path, label: str,
                   transfer: str, mode: str, work: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    name = f"bench-weights-{int(time.time() * 1000)}"
    config = config_for(url, redis_url, model_path, name, transfer, mode)
    await fresh_server(_UrlOnly(url, str(model_path)))  # type: ignore[arg-type]
    redis = aioredis.from_url(redis_url)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32) if transfer else None
    checkpoints = Checkpoints(work / name / "ckpt")
    trainer_s: list[float] = []
    paused: list[float] = []
    mib: list[float] = []
    try:
        async with rollout_side(config, redis) as engine, VersionPublisher(config, checkpoints) as publisher:
            lanes = lanes_of(engine, args.lanes, args.new_tokens, args.vocab)
            watcher = asyncio.create_task(pauses(redis, config, paused))
            await asyncio.sleep(args.warmup)
            gen0, prompt0, started0 = await metric(url, "vllm:generation_tokens_total"), \
                await metric(url, "vllm:prompt_tokens_total"), lanes.started
            began = time.monotonic()
            version = 0
            while time.monotonic() - began < args.window:
                if model is None:
                    await asyncio.sleep(min(args.interval, args.window - (time.monotonic() - began)))
                    continue
                tick = time.monotonic()
                version += 1
                # the trainer's own work runs off the event loop, as a trainer is a process of its own
                await asyncio.to_thread(nudge, model, version)
                started = time.monotonic()
                if transfer == "checkpoint":
                    await asyncio.to_thread(save, checkpoints, version, model)
                    checkpoint = checkpoints.get(version)
                    mib.append(sum(f.stat().st_size for f in checkpoint.path.glob("*")) / 2**20)  # type: ignore[union-attr]
                    await publisher.publish(version, checkpoint)
                else:
                    await publisher.publish(version, model=model)
                    mib.append((publisher.last_transfer.bytes if publisher.last_transfer else 0) / 2**20)
                trainer_s.append(time.monotonic() - started)
                await asyncio.sleep(max(0.0, args.interval - (time.monotonic() - tick)))
            seconds = time.monotonic() - began
            gen1, prompt1, started1 = await metric(url, "vllm:generation_tokens_total"), \
                await metric(url, "vllm:prompt_tokens_total"), lanes.started
            await lanes.stop()
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
    finally:
        await redis.aclose()
    fresh_prompts = (started1 - started0) * PROMPT_TOKENS
    return {
        "mode": label, "versions": version, "trainer s": mean(trainer_s),
        "pause s": mean(paused), "pause p95 s": percentiles(paused, (95,))["p95"] if paused else float("nan"),
        "MiB": mean(mib) if mib else 0.0, "tokens/s": (gen1 - gen0) / seconds,
        "re-prefilled / update": max(0.0, prompt1 - prompt0 - fresh_prompts) / version if version else 0.0,
        "window s": seconds,
    }


class _UrlOnly:
    """What ``fresh_server`` needs of a server: its URL and its launch model."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=("tiny", "random"), default="tiny")
    parser.add_argument("--params", type=float, default=0.5, help="--model random: billions of parameters (>= 0.5)")
    parser.add_argument("--server-url", default=None, help="a running vLLM server started with "
                        "--no-enable-prefix-caching (default: start one locally); --model-path then names its model")
    parser.add_argument("--model-path", default=None, help="the served model's directory (with --server-url)")
    parser.add_argument("--redis-url", default=None, help="default: a local redis-server started here")
    parser.add_argument("--lanes", type=int, default=8, help="requests in flight")
    parser.add_argument("--new-tokens", type=int, default=None, help="per request (default 512; --quick 64)")
    parser.add_argument("--window", type=float, default=None, help="seconds measured per mode (default 30; --quick 4)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between versions")
    parser.add_argument("--warmup", type=float, default=None, help="seconds before the window (default 5; --quick 1)")
    parser.add_argument("--server-cpus", default="", help="the local server's cores (e.g. 0), as bench.server")
    parser.add_argument("--rounds", type=int, default=None,
                        help="every mode once a round, in turn; the best round of each counts (default 2; --quick 1)")


async def measure(args: argparse.Namespace, report: Report) -> None:
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-weights-") as tmp:
        work = Path(tmp)
        if args.model_path:
            model = Path(args.model_path)
        elif args.model == "random":
            from rollstream.config import cache_dir

            model = random_model(args.params, cache_dir() / "bench-models")
        else:
            from rollstream.testing.tiny import tiny_model_dir

            model = Path(tiny_model_dir())
        args.vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        modes = MODES[:1] + MODES[3:5] if args.quick else MODES
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in modes}
        with local_services(args, model, work) as (url, redis_url):
            for _ in range(args.rounds):  # the modes in turn, every round: each meets the machine's moods
                for label, transfer, mode in modes:
                    runs[label].append(await one_mode(args, url, redis_url, model, label, transfer, mode, work))
                    print(f"bench.weights: {runs[label][-1]}", file=sys.stderr)
    rows = [max(runs[label], key=lambda r: r["tokens/s"]) | {"runs": [round(r["tokens/s"]) for r in runs[label]]}
            for label, _, _ in modes]
    base = rows[0]["tokens/s"]
    for row in rows:
        row["% of no updates"] = 100 * row["tokens/s"] / base if base else float("nan")
    count = parameters(model)
    report.table(f"{model.name} ({count / 1e9:.2f}B parameters, float32, CPU) on vLLM: {args.lanes} requests of "
                 f"{PROMPT_TOKENS} + {args.new_tokens} tokens, a version every {args.interval:g}s", rows)
    report.extra.update(model=str(model), parameters=count, lanes=args.lanes, new_tokens=args.new_tokens)
    for row in rows:
        if "keep" in row["mode"]:
            report.target(f"{row['mode']}: tokens/s / no updates", row["tokens/s"] / base, TARGET)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("weights", __doc__.splitlines()[0])
    arguments(parser)
    args = parser.parse_args(argv)
    args.new_tokens = args.new_tokens or (64 if args.quick else 512)
    args.window = args.window or (4.0 if args.quick else 30.0)
    args.warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 5.0)
    args.rounds = args.rounds or (1 if args.quick else 2)
    report = Report("weights", args.quick)
    asyncio.run(measure(args, report))
    return report.finish(args.out)


if __name__ == "__main__":
    sys.exit(main())

"""Check that a live SGLang server behaves as rollstream (and its stand-in) assume. Needs a GPU.

The tests run against ``harness/fake_sglang.py``, a stand-in for SGLang 0.5.23; this
script checks the same points against a real server, and ``tests/unit/test_check_sglang.py``
runs it against the stand-in, so the two cannot drift apart unnoticed. Example:

    python -m sglang.launch_server --model-path /models/qwen --port 30000 &
    python scripts/check_sglang.py --url http://localhost:30000 --model-path /models/qwen

``--model-path`` is loaded with ``/update_weights_from_disk`` (the served model's own path is
fine) and, when possible, provides the tokenizer for the prompt. The control checks pause and
continue the first ``--url``: run this against a server nobody else uses. Prints PASS / FAIL /
INFO per check; exits 1 when any check fails. A NaN logprob written as ``null`` cannot be
provoked on a healthy model; the client's handling of it is tested against the stand-in.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rollstream.api.engine import WeightUpdate
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.config import ServerConfig
from rollstream.engines.sglang import SGLangEngine
from rollstream.engines.server_admin import time_epoch
from rollstream.engines.server_http import HttpRefused, ServerHttp, weight_label


class CheckFailed(AssertionError):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


@dataclass
class Ctx:
    args: argparse.Namespace
    engine: SGLangEngine
    ids: list[int]

    @property
    def url(self) -> str:
        return self.engine.servers[0].url

    @property
    def http(self) -> ServerHttp:
        return self.engine.http

    async def generate(self, body: dict[str, Any], timeout: float = 600) -> tuple[int, Any]:
        """POST /generate to the first server: ``(status, answer or SGLang's error message)``."""
        try:
            return 200, await self.http.post(self.url, "/generate", {"input_ids": self.ids, **body}, timeout)
        except HttpRefused as exc:
            return exc.status, exc.message

    def long_body(self, **extra: Any) -> dict[str, Any]:
        return {"sampling_params": {"max_new_tokens": self.args.long_tokens, "ignore_eos": True}, **extra}

    async def next_version(self) -> int:
        return ((await self.engine.admin.label(self.url)).version or 0) + 1


async def gen(ctx: Ctx, **kw: Any) -> ModelResponse:
    return await ctx.engine.agenerate(ModelRequest(input_ids=ctx.ids, gconfig=GenerationHyperparameters(**kw)))


def consistent(resp: ModelResponse) -> bool:
    return len(resp.output_tokens) == len(resp.output_logprobs) == len(resp.output_versions)


async def check_generate(ctx: Ctx) -> str:
    resp = await gen(ctx, max_new_tokens=16, temperature=0.8, top_p=0.95, top_k=50, frequency_penalty=0.1,
                     ignore_eos=True)
    expect(consistent(resp), "tokens/logprobs/versions lengths differ")
    expect(len(resp.output_tokens) == 16 and resp.stop_reason == "length", f"got {resp.stop_reason}")
    expect(all(lp <= 0 for lp in resp.output_logprobs), "a logprob is positive")
    status, answer = await ctx.generate({"sampling_params": {"max_new_tokens": 2}})
    expect(status == 200 and "weight_version" in answer["meta_info"], "meta_info has no weight_version")
    return f"16 tokens, logprobs {resp.output_logprobs[:3]}..., weight_version {answer['meta_info']['weight_version']!r}"


async def check_keys(ctx: Ctx) -> str:
    status, _ = await ctx.generate({"sampling_params": {"max_new_tokens": 2}, "rollstream_probe": 1})
    expect(status == 200, f"an unknown top-level key answered {status}, not 200 (ignored)")
    status, message = await ctx.generate({"sampling_params": {"max_tokens": 4}})
    expect(status == 400, f"an unknown sampling_params key answered {status}, not 400 (SGLang >= 0.5.22)")
    return f"top-level key ignored; max_tokens refused: {str(message)[:80]!r}"


async def check_skip_tokenizer_init(ctx: Ctx) -> str:
    status, info = await ctx.http.get(ctx.url, "/server_info", 30)
    skip = status == 200 and isinstance(info, dict) and bool(info.get("skip_tokenizer_init"))
    stop, _ = await ctx.generate({"sampling_params": {"max_new_tokens": 4, "stop": ["\n\n"]}})
    min_new, _ = await ctx.generate({"sampling_params": {"max_new_tokens": 4, "min_new_tokens": 2}})
    if not skip:
        return f"INFO: server has a tokenizer: stop -> {stop}, min_new_tokens -> {min_new}"
    expect(stop == 400 and min_new == 400, f"--skip-tokenizer-init: stop -> {stop}, min_new_tokens -> {min_new}")
    return "--skip-tokenizer-init: stop and min_new_tokens refused with 400"


async def check_weight_version(ctx: Ctx) -> str:
    version = await ctx.next_version()
    admin = ctx.engine.admin
    epoch = time_epoch()
    await admin.pause(ctx.url, epoch)
    try:
        await admin.load(ctx.url, WeightUpdate(version, ctx.args.model_path), epoch)
    finally:
        await admin.resume(ctx.url, epoch)
    status, answer = await ctx.generate({"sampling_params": {"max_new_tokens": 2}})
    reported = answer["meta_info"].get("weight_version") if status == 200 else None
    expect(reported == weight_label(version, epoch), f"/generate reports weight_version {reported!r}, loaded {version}")
    label = await admin.label(ctx.url)
    expect((label.version, label.epoch) == (version, epoch), "/model_info does not report the loaded version")
    return f"loaded as {reported!r}: /generate and /model_info report it"


async def check_blocking_pause(ctx: Ctx) -> str:
    running = asyncio.create_task(ctx.generate(ctx.long_body()))
    answered: list[float] = []
    running.add_done_callback(lambda _: answered.append(time.monotonic()))
    await asyncio.sleep(ctx.args.pause_after)
    started = time.monotonic()
    epoch = time_epoch()
    await ctx.engine.admin.pause(ctx.url, epoch)
    returned = time.monotonic()
    try:
        status, answer = await asyncio.wait_for(running, 60)
        finish = answer["meta_info"]["finish_reason"]["type"] if status == 200 else status
        expect(finish == "abort", f"the running request ended with {finish!r}, not abort")
        # SGLang writes the aborted answers before its pause answers; reading them may lag a little
        late = answered[0] - returned
        expect(late < 0.1, f"/pause_generation answered {late:.2f}s before the aborted request was")
    finally:
        await ctx.engine.admin.resume(ctx.url, epoch)
    return f"pause answered after {returned - started:.2f}s, once the aborted request was answered"


async def check_gate(ctx: Ctx) -> str:
    epoch = time_epoch()
    await ctx.engine.admin.pause(ctx.url, epoch)
    try:
        waiting = asyncio.create_task(ctx.generate({"sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}))
        await asyncio.sleep(ctx.args.gate_wait)
        expect(not waiting.done(), f"a request sent while paused was answered: {waiting.result() if waiting.done() else ''}")
    finally:
        await ctx.engine.admin.resume(ctx.url, epoch)
    status, answer = await asyncio.wait_for(waiting, 120)
    finish = answer["meta_info"]["finish_reason"]["type"] if status == 200 else status
    expect(finish == "length", f"after continue it ended with {finish!r}, not length (it must not be aborted)")
    return f"held at the gate for {ctx.args.gate_wait}s, served after continue"


async def check_duplicate_rid(ctx: Ctx) -> str:
    rid = f"rollstream-check-{time.time_ns()}"
    first = asyncio.create_task(ctx.generate(ctx.long_body(rid=rid)))
    await asyncio.sleep(ctx.args.pause_after)
    status, message = await ctx.generate({"rid": rid, "sampling_params": {"max_new_tokens": 2}})
    await first
    expect(status == 400 and "duplicate request id" in str(message).lower(),
           f"re-sending a held rid answered {status}: {str(message)[:100]!r}")
    return f"400 {str(message)[:60]!r}"


async def check_health_while_paused(ctx: Ctx) -> str:
    epoch = time_epoch()
    await ctx.engine.admin.pause(ctx.url, epoch)
    try:
        started = time.monotonic()
        version = (await ctx.engine.admin.label(ctx.url)).version
        info_s = time.monotonic() - started
        expect(info_s < 5, f"/model_info took {info_s:.1f}s while paused")
        started = time.monotonic()
        try:
            status, _ = await ctx.http.get(ctx.url, "/health", ctx.args.paused_health_timeout)
        except asyncio.TimeoutError:
            status = None
        health_s = time.monotonic() - started
    finally:
        await ctx.engine.admin.resume(ctx.url, epoch)
    expect(status == 503, f"/health while paused: {status} after {health_s:.1f}s, expected 503")
    return f"/model_info answered in {info_s:.2f}s (v{version}); /health 503 after {health_s:.1f}s"


async def check_concurrent_clients(ctx: Ctx) -> str:
    clients = [SGLangEngine(ctx.args.url, settings=ctx.engine.settings) for _ in range(3)]
    try:
        async def one(client: SGLangEngine) -> ModelResponse:
            req = ModelRequest(input_ids=ctx.ids, gconfig=GenerationHyperparameters(max_new_tokens=8, ignore_eos=True))
            return await client.agenerate(req)

        results = await asyncio.gather(*(one(c) for c in clients for _ in range(8)))
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    expect(all(len(r.output_tokens) == 8 and consistent(r) for r in results), "a concurrent request came back short")
    return f"{len(results)} requests from 3 clients at once"


async def check_abort_resume(ctx: Ctx) -> str:
    """A request cut by pause / load / continue: each span tagged with the version it reports."""
    version = await ctx.next_version()
    budget = ctx.args.long_tokens
    task = asyncio.create_task(gen(ctx, max_new_tokens=budget, ignore_eos=True))
    await asyncio.sleep(ctx.args.pause_after)
    started = time.monotonic()
    epoch = time_epoch()
    for url in ctx.args.url:
        await ctx.engine.admin.pause(url, epoch)
        try:
            await ctx.engine.admin.load(url, WeightUpdate(version, ctx.args.model_path), epoch)
        finally:
            await ctx.engine.admin.resume(url, epoch)
    update_s = time.monotonic() - started
    resp = await task
    expect(consistent(resp), "tokens/logprobs/versions lengths differ")
    expect(len(resp.output_tokens) == budget and resp.stop_reason == "length",
           f"{len(resp.output_tokens)} tokens, {resp.stop_reason}")
    expect(set(resp.output_versions) == {version - 1, version}, f"versions {sorted(set(resp.output_versions))}")
    k = resp.output_versions.index(version)
    expect(resp.output_versions == [version - 1] * k + [version] * (budget - k), "versions are not ordered")
    return f"{k} tokens at v{version - 1}, {budget - k} at v{version}; pause+update+continue {update_s:.1f}s"


async def check_greedy(ctx: Ctx) -> str:
    a = await gen(ctx, max_new_tokens=24, greedy=True, ignore_eos=True)
    b = await gen(ctx, max_new_tokens=24, greedy=True, ignore_eos=True)
    c = await gen(ctx, max_new_tokens=24, top_k=1, ignore_eos=True)
    expect(a.output_tokens == b.output_tokens, "two greedy runs differ")
    expect(a.output_tokens == c.output_tokens, "top_k=1 differs from greedy")
    return "greedy deterministic, top_k=1 == greedy"


async def check_stop_token(ctx: Ctx) -> str:
    ref = await gen(ctx, max_new_tokens=12, greedy=True, ignore_eos=True)
    stop = ref.output_tokens[5]
    first = ref.output_tokens.index(stop)
    resp = await gen(ctx, max_new_tokens=12, greedy=True, stop_token_ids=[stop])
    expect(resp.stop_reason == "stop", f"stop_reason {resp.stop_reason}")
    expect(resp.output_tokens == ref.output_tokens[: first + 1], "output is not the greedy prefix + stop token")
    return f"stopped on token {stop} after {first + 1} tokens (stop token kept)"


async def check_sticky(ctx: Ctx) -> str:
    if len(ctx.args.url) < 2:
        return "INFO: one --url, routing not checked"
    req = ModelRequest(input_ids=ctx.ids, gconfig=GenerationHyperparameters(max_new_tokens=4))
    homes = set()
    for _ in range(3):
        await ctx.engine.agenerate(req)
        homes.add(ctx.engine.server_for(req.rid))
    expect(len(homes) == 1, f"rid moved between {homes}")
    return f"rid stays on {homes.pop()}"


CHECKS: list[tuple[str, Callable[[Ctx], Awaitable[str]]]] = [
    ("generate with SGLang sampling keys", check_generate),
    ("unknown keys: top level ignored, sampling_params refused", check_keys),
    ("--skip-tokenizer-init refusals", check_skip_tokenizer_init),
    ("weight_version reported", check_weight_version),
    ("pause answers once aborted requests were answered", check_blocking_pause),
    ("a request sent while paused waits at the gate", check_gate),
    ("duplicate rid refused", check_duplicate_rid),
    ("health while paused", check_health_while_paused),
    ("concurrent clients", check_concurrent_clients),
    ("abort-resume across pause/update/continue, tags per span", check_abort_resume),
    ("greedy deterministic", check_greedy),
    ("stop token", check_stop_token),
    ("sticky rid routing", check_sticky),
]


def prompt_ids(model_path: str) -> list[int]:
    try:
        from transformers import AutoTokenizer

        return list(AutoTokenizer.from_pretrained(model_path)("Count from one to one hundred:").input_ids)
    except Exception:  # no tokenizer there: any small ids are valid for a real vocabulary
        return list(range(100, 112))


async def main(args: argparse.Namespace) -> int:
    settings = ServerConfig(health_timeout_seconds=args.health_timeout, request_timeout_seconds=600,
                            catch_up_timeout_seconds=60, max_version_lag=10**9)  # tags checked, not staleness
    engine = SGLangEngine(args.url, settings=settings)
    failed = 0
    try:
        await engine.start()
        print("PASS  servers up")
        ctx = Ctx(args, engine, prompt_ids(args.model_path))
        for name, check in CHECKS:
            if args.only and not any(word in name for word in args.only):
                continue
            try:
                detail = await check(ctx)
                label = "INFO" if detail.startswith("INFO:") else "PASS"
                print(f"{label}  {name}: {detail.removeprefix('INFO: ')}")
            except Exception as exc:  # report every check, then exit non-zero
                failed += 1
                print(f"FAIL  {name}: {exc!r}")
                if args.verbose:
                    traceback.print_exc()
    except Exception as exc:
        print(f"FAIL  servers up: {exc!r}")
        failed += 1
    finally:
        await engine.close()
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", required=True, help="server base URL (repeatable)")
    parser.add_argument("--model-path", required=True, help="weights directory for /update_weights_from_disk")
    parser.add_argument("--long-tokens", type=int, default=1024, help="budget of the requests cut by a pause")
    parser.add_argument("--pause-after", type=float, default=1.0, help="seconds a long request runs before the pause")
    parser.add_argument("--gate-wait", type=float, default=2.0, help="seconds a request must stay held while paused")
    parser.add_argument("--paused-health-timeout", type=float, default=40.0,
                        help="how long to wait for /health while paused (SGLang answers 503 after ~20 s)")
    parser.add_argument("--health-timeout", type=float, default=600)
    parser.add_argument("--only", action="append", help="run only checks whose name contains this (repeatable)")
    parser.add_argument("--verbose", action="store_true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))

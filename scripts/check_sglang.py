"""Run the SGLangEngine checks against a REAL SGLang server (needs a GPU machine; not run in CI).

The unit tests use tests/fakes/sglang_server.py; this script checks that the fake's assumptions
hold for a live server. Example:

    python -m sglang.launch_server --model-path /models/qwen --port 30000 &
    python scripts/check_sglang.py --url http://localhost:30000 --model-path /models/qwen

``--model-path`` is loaded with ``/update_weights_from_disk`` for the weight-update check (the
served model's own path is fine) and, when possible, provides the tokenizer for the prompt.
Prints PASS / FAIL / INFO per check; exits 1 when any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import traceback
from typing import Any, Awaitable, Callable

import aiohttp

from rollstream.api.engine import WeightUpdate
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.engines.sglang import SGLangEngine

Check = Callable[[SGLangEngine, argparse.Namespace, list[int]], Awaitable[str]]


class CheckFailed(AssertionError):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


async def gen(engine: SGLangEngine, ids: list[int], **kw: Any) -> ModelResponse:
    return await engine.agenerate(ModelRequest(input_ids=ids, gconfig=GenerationHyperparameters(**kw)))


def consistent(resp: ModelResponse) -> bool:
    return len(resp.output_tokens) == len(resp.output_logprobs) == len(resp.output_versions)


async def check_generate(engine: SGLangEngine, args: argparse.Namespace, ids: list[int]) -> str:
    resp = await gen(engine, ids, max_new_tokens=16, min_new_tokens=2, temperature=0.8, top_p=0.95,
                     top_k=50, stop=["\n\n\n"], frequency_penalty=0.1, ignore_eos=True)
    expect(consistent(resp), "tokens/logprobs/versions lengths differ")
    expect(len(resp.output_tokens) == 16 and resp.stop_reason == "length", f"got {resp.stop_reason}")
    expect(all(lp <= 0 for lp in resp.output_logprobs), "a logprob is positive")
    return f"16 tokens, logprobs {resp.output_logprobs[:3]}..."


async def check_unknown_key(engine: SGLangEngine, args: argparse.Namespace, ids: list[int]) -> str:
    body = {"input_ids": ids, "sampling_params": {"max_tokens": 4}}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{args.url[0]}/generate", json=body) as resp:
            text = await resp.text()
    if resp.status == 400:
        return f"max_tokens rejected with 400 ({text[:80]!r})"
    return f"INFO: max_tokens accepted with {resp.status} (SGLang < 0.5.23 ignores unknown keys)"


async def check_greedy(engine: SGLangEngine, args: argparse.Namespace, ids: list[int]) -> str:
    a = await gen(engine, ids, max_new_tokens=24, greedy=True, ignore_eos=True)
    b = await gen(engine, ids, max_new_tokens=24, greedy=True, ignore_eos=True)
    c = await gen(engine, ids, max_new_tokens=24, top_k=1, ignore_eos=True)
    expect(a.output_tokens == b.output_tokens, "two greedy runs differ")
    expect(a.output_tokens == c.output_tokens, "top_k=1 differs from greedy")
    return "greedy deterministic, top_k=1 == greedy"


async def check_stop_token(engine: SGLangEngine, args: argparse.Namespace, ids: list[int]) -> str:
    ref = await gen(engine, ids, max_new_tokens=12, greedy=True, ignore_eos=True)
    stop = ref.output_tokens[5]
    first = ref.output_tokens.index(stop)
    resp = await gen(engine, ids, max_new_tokens=12, greedy=True, stop_token_ids=[stop])
    expect(resp.stop_reason == "stop", f"stop_reason {resp.stop_reason}")
    expect(resp.output_tokens == ref.output_tokens[: first + 1], "output is not the greedy prefix + stop token")
    return f"stopped on token {stop} after {first + 1} tokens (stop token kept)"


async def check_abort_resume(engine: SGLangEngine, args: argparse.Namespace, ids: list[int]) -> str:
    budget = args.long_tokens
    version = engine.get_version() + 1
    task = asyncio.create_task(gen(engine, ids, max_new_tokens=budget, ignore_eos=True))
    await asyncio.sleep(args.pause_after)
    started = time.monotonic()
    await engine.pause()
    await engine.update_weights(WeightUpdate(version=version, path=args.model_path))
    await engine.resume()
    update_s = time.monotonic() - started
    resp = await task
    expect(consistent(resp), "tokens/logprobs/versions lengths differ")
    expect(len(resp.output_tokens) == budget and resp.stop_reason == "length",
           f"{len(resp.output_tokens)} tokens, {resp.stop_reason}")
    expect(set(resp.output_versions) == {version - 1, version}, f"versions {sorted(set(resp.output_versions))}")
    k = resp.output_versions.index(version)
    expect(resp.output_versions == [version - 1] * k + [version] * (budget - k), "versions are not ordered")
    return f"{k} tokens at v{version - 1}, {budget - k} at v{version}; pause+update+continue {update_s:.1f}s"


async def check_sticky(engine: SGLangEngine, args: argparse.Namespace, ids: list[int]) -> str:
    if len(args.url) < 2:
        return "INFO: one --url, routing not checked"
    req = ModelRequest(input_ids=ids, gconfig=GenerationHyperparameters(max_new_tokens=4))
    homes = set()
    for _ in range(3):
        await engine.agenerate(req)
        homes.add(engine.server_for(req.rid))
    expect(len(homes) == 1, f"rid moved between {homes}")
    return f"rid stays on {homes.pop()}"


CHECKS: list[tuple[str, Check]] = [
    ("generate with SGLang sampling keys", check_generate),
    ("unknown sampling key rejected", check_unknown_key),
    ("greedy deterministic", check_greedy),
    ("stop token", check_stop_token),
    ("abort-resume across pause/update/continue", check_abort_resume),
    ("sticky rid routing", check_sticky),
]


def prompt_ids(model_path: str) -> list[int]:
    try:
        from transformers import AutoTokenizer

        return list(AutoTokenizer.from_pretrained(model_path)("Count from one to one hundred:").input_ids)
    except Exception:  # no tokenizer there: any small ids are valid for a real vocabulary
        return list(range(100, 112))


async def main(args: argparse.Namespace) -> int:
    engine = SGLangEngine(args.url, health_timeout=args.health_timeout, request_timeout=600)
    failed = 0
    try:
        await engine.start()
        print("PASS  health")
        ids = prompt_ids(args.model_path)
        for name, check in CHECKS:
            try:
                detail = await check(engine, args, ids)
                label = "INFO" if detail.startswith("INFO:") else "PASS"
                print(f"{label}  {name}: {detail.removeprefix('INFO: ')}")
            except Exception as exc:  # report every check, then exit non-zero
                failed += 1
                print(f"FAIL  {name}: {exc!r}")
                if args.verbose:
                    traceback.print_exc()
    except Exception as exc:
        print(f"FAIL  health: {exc!r}")
        failed += 1
    finally:
        await engine.close()
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", required=True, help="server base URL (repeatable)")
    parser.add_argument("--model-path", required=True, help="weights directory for /update_weights_from_disk")
    parser.add_argument("--long-tokens", type=int, default=1024, help="budget of the request cut by the pause")
    parser.add_argument("--pause-after", type=float, default=1.0, help="seconds before pausing it")
    parser.add_argument("--health-timeout", type=float, default=600)
    parser.add_argument("--verbose", action="store_true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))

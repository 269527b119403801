"""HFEngine against a tiny offline model: sampling, logprobs, stopping, batching, weight updates."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from rollstream.api.engine import WeightUpdate
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.engines.hf import HFEngine
from rollstream.tiny.text_model import build_tiny_model, default_corpus

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hf-engine") / "tiny", default_corpus())


@pytest.fixture(scope="session")
def ref_model(tiny_model_path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


@pytest.fixture(scope="module")
async def engine(tiny_model_path: Path) -> Any:
    eng = HFEngine(str(tiny_model_path), seed=0)
    await eng.start()
    yield eng
    await eng.close()


def ref_logprobs(model: Any, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of ``output`` from one fresh full forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return torch.log_softmax(logits / temperature, -1)[positions, torch.tensor(output)]


def assert_logprobs(model: Any, resp: ModelResponse, temperature: float = 1.0, start: int = 0) -> None:
    ref = ref_logprobs(model, resp.input_tokens, resp.output_tokens, temperature)[start:]
    got = torch.tensor(resp.output_logprobs)[start:]
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def prompts(engine: HFEngine, n: int) -> list[list[int]]:
    return [engine.tokenizer(f"What is {i}+{2 * i + 1}? Answer:").input_ids[: 4 + i % 5] for i in range(n)]


async def gen(engine: HFEngine, ids: list[int], **kw: Any) -> ModelResponse:
    return await engine.agenerate(ModelRequest(input_ids=ids, gconfig=GenerationHyperparameters(**kw)))


async def test_sampled_lengths_and_logprobs_match_forward(engine: HFEngine, ref_model: Any) -> None:
    kw = dict(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=50, ignore_eos=True)
    resps = await asyncio.gather(*(gen(engine, p, **kw) for p in prompts(engine, 3)))
    for resp in resps:
        assert len(resp.output_tokens) == len(resp.output_logprobs) == len(resp.output_versions) == 12
        assert resp.stop_reason == "length" and set(resp.output_versions) == {0}
        assert_logprobs(ref_model, resp, temperature=0.7)


async def test_greedy_is_deterministic_and_top_k_1_equals_greedy(engine: HFEngine, ref_model: Any) -> None:
    ids = prompts(engine, 1)[0]
    a = await gen(engine, ids, max_new_tokens=10, greedy=True, ignore_eos=True)
    b = await gen(engine, ids, max_new_tokens=10, greedy=True, ignore_eos=True)
    c = await gen(engine, ids, max_new_tokens=10, top_k=1, temperature=0.8, ignore_eos=True)
    assert a.output_tokens == b.output_tokens == c.output_tokens
    assert_logprobs(ref_model, a, temperature=1.0)  # greedy logprobs use T = 1


async def test_stop_token_min_new_tokens_and_budget(engine: HFEngine) -> None:
    ids = prompts(engine, 2)[1]
    greedy = await gen(engine, ids, max_new_tokens=8, greedy=True, ignore_eos=True)
    stop_tok = greedy.output_tokens[3]
    first = greedy.output_tokens.index(stop_tok)
    stopped = await gen(engine, ids, max_new_tokens=8, greedy=True, stop_token_ids=[stop_tok])
    assert stopped.stop_reason == "stop" and stopped.output_tokens == greedy.output_tokens[: first + 1]
    banned = await gen(engine, ids, max_new_tokens=8, greedy=True, stop_token_ids=[greedy.output_tokens[0]],
                       min_new_tokens=3)
    assert greedy.output_tokens[0] not in banned.output_tokens[:3] and len(banned.output_tokens) >= 3
    short = await gen(engine, ids, max_new_tokens=5, ignore_eos=True)
    assert short.stop_reason == "length" and len(short.output_tokens) == 5
    capped = await gen(engine, ids, max_new_tokens=100, max_tokens=len(ids) + 3, ignore_eos=True)
    assert capped.stop_reason == "length" and len(capped.output_tokens) == 3
    with pytest.raises(ValueError):
        await gen(engine, ids, max_tokens=len(ids))


def test_eos_is_a_stop_token_unless_ignore_eos(engine: HFEngine) -> None:
    eos = engine.tokenizer.eos_token_id
    assert eos in engine._spec(GenerationHyperparameters()).stop_ids
    assert eos not in engine._spec(GenerationHyperparameters(ignore_eos=True)).stop_ids


async def test_concurrent_requests_join_and_leave_the_batch(tiny_model_path: Path, ref_model: Any) -> None:
    eng = HFEngine(str(tiny_model_path), max_batch_size=4, seed=1)
    try:
        ps = prompts(eng, 10)
        budgets = [3 + (i * 7) % 13 for i in range(10)]
        resps = await asyncio.gather(*(gen(eng, p, max_new_tokens=b, ignore_eos=True) for p, b in zip(ps, budgets)))
    finally:
        await eng.close()
    for resp, budget in zip(resps, budgets):
        assert len(resp.output_tokens) == budget
        assert_logprobs(ref_model, resp)  # exercises the cache merge / trim paths


def perturbed_copy(src: Path, dst: Path, seed: int = 7) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    gen_ = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen_))
    model.save_pretrained(dst)
    return dst


async def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


async def test_pause_update_resume_mixes_versions(tiny_model_path: Path, ref_model: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    new_path = perturbed_copy(tiny_model_path, tmp_path / "v1")
    new_model = AutoModelForCausalLM.from_pretrained(new_path).eval()
    eng = HFEngine(str(tiny_model_path), seed=2)
    await eng.start()
    try:
        tasks = [asyncio.create_task(gen(eng, p, max_new_tokens=40, ignore_eos=True)) for p in prompts(eng, 4)]
        await wait_for(lambda: eng.stats.tokens_generated >= 4 * 6)
        await eng.pause()
        frozen = eng.stats.tokens_generated
        late = asyncio.create_task(gen(eng, prompts(eng, 5)[4], max_new_tokens=6, ignore_eos=True))
        await asyncio.sleep(0.1)
        assert eng.stats.tokens_generated == frozen and not late.done()  # paused means paused
        await eng.update_weights(WeightUpdate(version=1, path=str(new_path)))
        assert eng.get_version() == 1
        await eng.resume()
        resps = await asyncio.gather(*tasks)
        assert set((await late).output_versions) == {1}
    finally:
        await eng.close()
    for resp in resps:
        k = resp.output_versions.index(1)
        assert 0 < k < 40 and resp.output_versions == [0] * k + [1] * (40 - k)
        assert_logprobs(ref_model, ModelResponse(resp.input_tokens, resp.output_tokens[:k], resp.output_logprobs[:k]))
        assert_logprobs(new_model, resp, start=k)
        old = ref_logprobs(ref_model, resp.input_tokens, resp.output_tokens)[k:]
        assert (old - torch.tensor(resp.output_logprobs[k:])).abs().max() > 1e-3  # the update mattered


async def test_bad_checkpoint_is_rejected_and_weights_kept(engine: HFEngine, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"not.a.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="does not match"):
        await engine.update_weights(WeightUpdate(version=9, path=str(tmp_path)))
    assert engine.get_version() == 0


async def test_a_malformed_request_fails_alone_in_a_shared_decode_pass(engine: HFEngine) -> None:
    good = engine.tokenizer("What is 2+2? Answer:").input_ids
    encoding = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, return_dict=True)
    bad = [[100000], list(encoding), [good, good], ["1", "2"], [1] * 2048]
    results = await asyncio.gather(  # what transformers returns is taken: the encoding, a batch of one
        *(gen(engine, ids, max_new_tokens=6) for ids in [good, encoding, *bad, [good]]), return_exceptions=True
    )
    for resp in (results[0], results[1], results[-1]):
        assert isinstance(resp, ModelResponse) and resp.output_len > 0, resp
    assert results[1].input_tokens == list(encoding["input_ids"]) and results[-1].input_tokens == good
    messages = [str(r) for r in results[2:-1]]
    assert all(isinstance(r, ValueError) for r in results[2:-1]), results
    assert "input_ids[0] = 100000 is outside the model's vocabulary" in messages[0]
    assert "list() of a BatchEncoding" in messages[1]
    assert "nested: 2 prompts" in messages[2] and "string '1'" in messages[3] and "context holds 2048" in messages[4]


async def test_the_budget_is_capped_by_the_context(engine: HFEngine) -> None:
    resp = await gen(engine, [1] * 2044, max_new_tokens=20, ignore_eos=True)
    assert resp.output_len == 4 and resp.stop_reason == "length"

"""A real vLLM server (CPU) started in a non-default setting of ``rollout.launch``: bfloat16,
a smaller batch, eager. Its tokens are tagged and their logprobs audited as on the float32
server, with the audit's bfloat16 tolerance (``harness.logprob_audit.TOLERANCES``), which this
test measures: the largest error of a token against its own version's bfloat16 forward pass,
and how far the next version's logprobs lie (the tolerance must tell them apart)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from harness.checkpoints import fresh_engine, save_versions
from harness.logprob_audit import TOLERANCES, LogprobAuditor, LogprobTagAudit
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.config import ServerConfig, ServerLaunchConfig
from rollstream.dev.vllm_server import LocalVLLMServer
from rollstream.engines.vllm import VLLMEngine
from rollstream.testing.tiny import tiny_model_dir

pytestmark = pytest.mark.timeout(400)

LAUNCH = ServerLaunchConfig(dtype="bfloat16", max_num_seqs=4, max_model_len=512, cuda_graphs=False)
SETTINGS = ServerConfig(health_timeout_seconds=60, version_poll_seconds=0.05)
PROMPTS = [[11 + i, 12, 13, 14 + i, 15] for i in range(6)]


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalVLLMServer]:
    server = LocalVLLMServer(tmp_path_factory.mktemp("vllm-bf16"), tiny_model_dir(), LAUNCH)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def engine(bf16_server: LocalVLLMServer) -> AsyncIterator[VLLMEngine]:
    async with fresh_engine(bf16_server, SETTINGS) as started:
        yield started


def audited(responses: list[ModelResponse], weights: list[Path], dtype: str,
            as_version: int | None = None) -> LogprobTagAudit:
    """The audit of ``responses`` (as tagged, or all read ``as_version``) in ``dtype``."""
    checker = LogprobAuditor(weights, dtype=dtype)
    for i, resp in enumerate(responses):
        n, m = len(resp.input_tokens), len(resp.output_tokens)
        versions = resp.output_versions if as_version is None else [as_version] * m
        checker.row(resp.input_tokens + resp.output_tokens, [False] * n + [True] * m,
                    [0.0] * n + resp.output_logprobs, [-1] * n + versions, f"response {i}")
    return checker.result


async def test_a_bfloat16_server_tags_every_token_within_the_bfloat16_tolerance(
    bf16_server: LocalVLLMServer, engine: VLLMEngine, tmp_path: Path,
) -> None:
    log = bf16_server.log_path.read_text(errors="replace")
    assert "dtype=torch.bfloat16" in log, "the server did not start in bfloat16"
    responses = [await engine.agenerate(ModelRequest(input_ids=p, gconfig=GenerationHyperparameters(max_new_tokens=48, ignore_eos=True)))
                 for p in PROMPTS]
    assert all(r.output_versions == [0] * 48 for r in responses)
    weights = save_versions(Path(bf16_server.model), tmp_path, 1)
    own = audited(responses, weights, "bfloat16")
    in_float32 = audited(responses, weights, "float32")
    wrong = audited(responses, weights, "bfloat16", as_version=1)
    print(f"\nbfloat16 server, {own.tokens} tokens: |logprob - bf16 forward of its version| max {own.max_error:.4f}, "
          f"p99 {quantile(own.errors, 0.99):.4f}, median {quantile(own.errors, 0.5):.4f} (tolerance "
          f"{TOLERANCES['bfloat16']}); against a float32 forward pass: max {max(in_float32.errors):.4f}; "
          f"against the next version's bf16 forward pass: median {quantile(wrong.errors, 0.5):.4f}, "
          f"{wrong.mistagged} of {wrong.tokens} tokens beyond the tolerance, {wrong.rows_flagged} of {wrong.rows} rows")
    assert own.tokens == 6 * 48 and own.mistagged == 0, own.examples
    # the tolerance still tells versions apart: every row read as the wrong version is caught
    assert wrong.rows_flagged == wrong.rows and wrong.mistagged >= wrong.tokens / 2, wrong


def quantile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]

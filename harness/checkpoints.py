"""Weights of distinct versions: perturbed copies of a model saved as checkpoints, and the
session's vLLM server put back on its launch weights (version 0), with an engine on it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rollstream.api.engine import WeightUpdate
from rollstream.config import ServerConfig
from rollstream.dev.vllm_server import LocalVLLMServer
from rollstream.engines.server_admin import time_epoch
from rollstream.engines.server_http import ServerHttp
from rollstream.engines.vllm import VLLMEngine
from rollstream.engines.vllm_admin import VLLMAdmin


def save_versions(base: Path, out: Path, versions: int) -> list[Path]:
    """Version 0 is the built model; version v > 0 is a perturbed copy (distinct weights)."""
    paths = [base]
    model = AutoModelForCausalLM.from_pretrained(base)
    for version in range(1, versions + 1):
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.02)
        path = out / f"v{version}"
        model.save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (base / name).exists():
                (path / name).write_bytes((base / name).read_bytes())
        paths.append(path)
    return paths


async def fresh_server(server: LocalVLLMServer) -> None:
    """Put the session server back on its launch weights, labelled version 0 (a test before may
    have loaded others), running."""
    http = ServerHttp(ServerConfig())
    admin = VLLMAdmin(http)
    epoch = time_epoch()
    try:
        await admin.pause(server.url, epoch)
        await admin.load(server.url, WeightUpdate(0, server.model), epoch)
        await admin.resume(server.url, epoch)
    finally:
        await http.close()


@contextlib.asynccontextmanager
async def fresh_engine(server: LocalVLLMServer, settings: ServerConfig,
                       weight_update_mode: str = "abort") -> AsyncIterator[VLLMEngine]:
    """A started ``VLLMEngine`` on ``server``, put back on its launch weights first; closed after."""
    await fresh_server(server)
    engine = VLLMEngine([server.url], server.model, settings, weight_update_mode)  # type: ignore[arg-type]
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()

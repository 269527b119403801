"""The compose ``sglang`` service: a pinned image, every reserved GPU used, a health check that
survives a weight update, and the minimum Compose version stated.

The service's shell command and health check are run here as written (compose's ``$$`` made
``$``): the command with a stand-in ``python3`` that prints its arguments, the health check
with ``curl`` against the SGLang stand-in while it is paused for a weight update and while down.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest

from harness.compose import COMPOSE, load_compose
from harness.fake_sglang import FakeSGLangServer
from harness.services import free_port
from rollstream.config import ServerLaunchConfig
from rollstream.engines.server_launch import sglang_flags


pytestmark = pytest.mark.timeout(60)


def sglang(env: dict[str, str] | None = None) -> dict:
    return load_compose(env)["services"]["sglang"]


def container_shell(text: str) -> str:
    return text.replace("$$", "$")  # what compose hands the container


def test_image_is_pinned_and_the_minimum_compose_version_stated() -> None:
    assert re.fullmatch(r"lmsysorg/sglang:v0\.5\.23(-cu\d+)?", sglang()["image"])
    header = COMPOSE.read_text().split("services:")[0]
    assert "Docker Compose 1.29 or newer" in header


@pytest.mark.parametrize(("gpus", "dp", "tp"), [("1", "1", "1"), ("4", "1", "4"), ("4", "2", "2"), ("8", "8", "1")])
def test_the_server_uses_sglang_gpus_gpus(tmp_path: Path, gpus: str, dp: str, tp: str) -> None:
    service = sglang({"SGLANG_GPUS": gpus, "SGLANG_DP": dp})
    # a literal: docker-compose 1.29 keeps an interpolated count a string and refuses the file
    assert service["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    out = run_command(service, tmp_path)
    assert out.returncode == 0, out.stderr
    args = out.stdout.split()
    assert args[args.index("--tp-size") + 1] == tp and args[args.index("--dp-size") + 1] == dp
    assert int(tp) * int(dp) == int(gpus)


def test_the_launch_settings_come_from_the_environment(tmp_path: Path) -> None:
    """rollout.launch's settings as compose's variables become SGLang's flags as
    ``rollstream.engines.server_launch`` writes them (the defaults: bfloat16, no eager)."""
    out = run_command(sglang(), tmp_path)
    args = out.stdout.split()
    assert args[args.index("--dtype") + 1] == "bfloat16" and "--disable-cuda-graph" not in args
    assert "--context-length" not in args
    env = {"SGLANG_DTYPE": "float16", "SGLANG_MEMORY_FRACTION": "0.7", "SGLANG_MAX_RUNNING_REQUESTS": "64",
           "SGLANG_CONTEXT_LENGTH": "4096", "SGLANG_EAGER": "1", "SGLANG_NO_PREFIX_CACHE": "1"}
    args = run_command(sglang(env), tmp_path).stdout.split()
    launch = ServerLaunchConfig(dtype="float16", memory_fraction=0.7, max_num_seqs=64, max_model_len=4096,
                                cuda_graphs=False, prefix_caching=False)
    flags = sglang_flags(launch, "cuda")
    for flag in ("--dtype", "--mem-fraction-static", "--max-running-requests", "--context-length"):
        assert args[args.index(flag) + 1] == flags[flags.index(flag) + 1], flag
    for switch in ("--disable-cuda-graph", "--disable-radix-cache"):
        assert switch in args and switch in flags, switch


def test_gpus_not_a_multiple_of_dp_is_refused(tmp_path: Path) -> None:
    out = run_command(sglang({"SGLANG_GPUS": "3", "SGLANG_DP": "2"}), tmp_path)
    assert out.returncode == 1 and "not a multiple of SGLANG_DP" in out.stderr


def run_command(service: dict, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    env = {**{k: str(v) for k, v in service["environment"].items()}, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    command = [container_shell(part) for part in service["command"]]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=30, check=False)


async def health(url: str) -> int:
    test = sglang()["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL"
    proc = await asyncio.create_subprocess_shell(container_shell(test[1]).replace("http://localhost:30000", url))
    return await asyncio.wait_for(proc.wait(), 30)


@pytest.mark.skipif(shutil.which("curl") is None, reason="the health check runs curl")
async def test_health_check_passes_while_paused_for_an_update_and_fails_when_down() -> None:
    service = sglang()
    interval = int(service["healthcheck"]["timeout"].rstrip("s"))
    async with FakeSGLangServer() as server:  # /health hangs ~20 s while paused, like SGLang
        assert await health(server.url) == 0
        async with aiohttp.ClientSession() as session:
            await session.post(f"{server.url}/pause_generation", json={"mode": "abort"})
        started = asyncio.get_running_loop().time()
        assert await health(server.url) == 0  # up, paused for a weight update
        assert asyncio.get_running_loop().time() - started < interval  # within the check's timeout
    assert await health(f"http://127.0.0.1:{free_port()}") != 0  # down

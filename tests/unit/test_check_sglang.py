"""scripts/check_sglang.py against the SGLang stand-in: every check passes, and a stand-in that
misbehaves the way the old fake did (a pause that answers at once) makes its check fail.

The script is what checks a real SGLang server on a GPU machine; running it here keeps the
stand-in and the script in agreement, point by point.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp import web

from harness.fake_sglang import FakeSGLangServer


pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_sglang.py"
FAST_ARGS = ["--model-path", "/ckpt/check", "--long-tokens", "200", "--pause-after", "0.3", "--gate-wait", "0.5",
             "--paused-health-timeout", "5", "--health-timeout", "10"]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_sglang", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_sglang"] = module
    spec.loader.exec_module(module)
    return module


def standin(**kw: Any) -> FakeSGLangServer:
    return FakeSGLangServer(token_delay=0.005, health_pause_timeout=1.0, **kw)


async def test_every_check_passes_against_the_standin(capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script()
    async with standin() as a, standin() as b:
        code = await script.main(script.parse_args(["--url", a.url, "--url", b.url, *FAST_ARGS]))
    out = capsys.readouterr().out
    print(out)
    lines = [line for line in out.splitlines() if line[:4] in ("PASS", "FAIL", "INFO")]
    assert code == 0 and not [line for line in lines if line.startswith("FAIL")]
    assert len(lines) == 1 + len(script.CHECKS)
    assert all(line.startswith("PASS") for line in lines)  # the stand-in models --skip-tokenizer-init


class EagerPause(FakeSGLangServer):
    """The old fake's pause: answers at once, before the aborted requests were answered."""

    async def _pause(self, request: web.Request) -> web.Response:
        self._paused = True
        self._open_gate.clear()
        for running in self._running.values():
            running.abort = "paused"
        return web.json_response({"message": "Generation paused successfully."})


async def test_a_pause_that_does_not_wait_fails_its_check(capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script()
    async with EagerPause(token_delay=0.5, health_pause_timeout=1.0) as server:  # aborts at the next token
        args = ["--url", server.url, *FAST_ARGS, "--pause-after", "0.1", "--only", "pause answers"]
        code = await script.main(script.parse_args(args))
    out = capsys.readouterr().out
    assert code == 1 and "FAIL  pause answers once aborted requests were answered" in out, out

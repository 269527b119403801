"""The scripts our docs point users to still run, in their smallest form (a rename that breaks
one fails here, not on a user's GPU machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_check_trainer_gpu_runs_on_cpu() -> None:
    done = subprocess.run([sys.executable, "scripts/check_trainer_gpu.py", "--ranks", "1", "--cpu"], cwd=REPO,
                          capture_output=True, text=True, timeout=280)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "FAIL" not in output and output.count("PASS") >= 4, output[-4000:]

"""The scripts our docs point users to still run, in their smallest form (a rename that breaks
one fails here, not on a user's GPU machine).

``scripts/check_sglang.py`` runs against the SGLang stand-in in ``tests/unit/test_check_sglang.py``;
``tests/unit/test_entry_points_covered.py`` lists which test runs each script, and why the rest
(installers, Docker) run only in CI.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_check_trainer_gpu_runs_on_cpu() -> None:
    done = subprocess.run([sys.executable, "scripts/check_trainer_gpu.py", "--ranks", "1", "--cpu"], cwd=REPO,
                          check=False, capture_output=True, text=True, timeout=280)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "FAIL" not in output and output.count("PASS") >= 4, output[-4000:]


def test_demo_script_reaches_the_demo(tmp_path: Path) -> None:
    """``bash scripts/demo.sh --help``: the script as shipped, its setup step standing in (CI ran the
    real ``scripts/setup.sh`` before the suite; run again, it would reinstall the package under the
    running tests), its arguments passed through to ``rollstream demo`` (the demo itself:
    tests/integration/test_demo.py)."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    shutil.copy(REPO / "scripts" / "demo.sh", scripts / "demo.sh")
    ran = tmp_path / "setup ran"
    (scripts / "setup.sh").write_text(f"touch '{ran}'\n")
    done = subprocess.run(["bash", str(scripts / "demo.sh"), "--help"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert ran.exists(), "demo.sh no longer runs scripts/setup.sh first"
    assert "usage: rollstream demo" in done.stdout and "--trainer-ranks" in done.stdout, done.stdout

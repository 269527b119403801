"""The torch tripwire (``harness/torch_tripwire.py``) trips on a real import of torch,
not on looking it up, and the modules of the producer, reward, grouping and dump tiers (and the
``rollstream`` command's parser that runs them) import without tripping it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.torch_tripwire import TRIPPED


REPO = Path(__file__).resolve().parents[2]
ARMED = "from harness.torch_tripwire import install; install()\n"


def run_armed(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", ARMED + code], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_tier_modules_import_without_torch() -> None:
    done = run_armed(
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('torch') is not None  # looking it up is not importing it\n"
        "import rollstream.producers.service, rollstream.consumers.grouping.service, rollstream.consumers.dump.service\n"
        "import rollstream.reward_workers.service, rollstream.rewards.wrapper\n"
        "from rollstream.cli import build_parser\n"
        "build_parser()\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    assert done.returncode == 0, done.stderr


def test_importing_torch_anywhere_trips_it_naming_the_importer() -> None:
    done = run_armed("import rollstream.wire\nimport rollstream.wire.torch_tensors\n")  # the torch face
    assert done.returncode == TRIPPED
    assert "TORCH TRIPWIRE: torch imported from" in done.stderr and "torch_tensors.py" in done.stderr

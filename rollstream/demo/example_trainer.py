"""Find the example GRPO trainer (``examples/grpo_trainer.py``) without the core importing it.

``examples/`` is not an installed package: it lives in the repository (and in the compose
image). It is imported as ``examples.grpo_trainer`` when that works, else from the current
directory or from the checkout the ``rollstream`` package was installed from (editable
installs).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

MODULE = "examples.grpo_trainer"


def _candidate_roots() -> list[Path]:
    package_root = Path(__file__).resolve().parents[2]
    return [Path.cwd(), package_root]


def load_example_trainer() -> ModuleType:
    """The ``examples.grpo_trainer`` module; ``ImportError`` saying where it was looked for."""
    try:
        return importlib.import_module(MODULE)
    except ModuleNotFoundError as exc:
        if exc.name not in ("examples", MODULE):
            raise  # the trainer itself failed to import something: show that error
    roots = _candidate_roots()
    for root in roots:
        if (root / "examples" / "grpo_trainer.py").is_file():
            sys.path.insert(0, str(root))
            sys.modules.pop("examples", None)
            return importlib.import_module(MODULE)
    raise ImportError(
        "cannot find examples/grpo_trainer.py (looked in "
        + ", ".join(str(r) for r in roots)
        + "): run from the repository root, or put the repository on PYTHONPATH"
    )

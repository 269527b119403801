"""Find and launch the example GRPO trainer (``examples/grpo_trainer.py``) without the core
importing it.

``examples/`` is not an installed package: it lives in the repository (and in the compose
image). It is found in the current directory or in the checkout the ``rollstream`` package
was installed from (editable installs), and run as a child process: ``python
examples/grpo_trainer.py`` for one rank, ``python -m torch.distributed.run --standalone
--nproc-per-node N examples/grpo_trainer.py`` (``torchrun``) for N.
"""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPT = Path("examples") / "grpo_trainer.py"
# torchrun's restarts otherwise reuse the rendezvous keys of the failed run and its workers
# cannot connect (pytorch/pytorch#135712); harmless without restarts.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _candidate_roots() -> list[Path]:
    package_root = Path(__file__).resolve().parents[2]
    return [Path.cwd(), package_root]


def example_trainer_path() -> Path:
    """``examples/grpo_trainer.py``; ``FileNotFoundError`` saying where it was looked for."""
    roots = _candidate_roots()
    for root in roots:
        if (root / SCRIPT).is_file():
            return (root / SCRIPT).resolve()
    raise FileNotFoundError(
        f"cannot find {SCRIPT} (looked in " + ", ".join(str(r) for r in roots)
        + "): run from the repository root, or put the repository on PYTHONPATH"
    )


def trainer_argv(config_path: str | Path | None, ranks: int = 1, steps_file: Path | None = None,
                 overrides: list[str] | None = None) -> list[str]:
    """The command line of the example trainer on ``ranks`` ranks (torchrun when more than one)."""
    script = str(example_trainer_path())
    launcher = [sys.executable, script] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", script]
    argv = [*launcher, *(["--config", str(config_path)] if config_path else [])]
    if steps_file is not None:
        argv += ["--steps-file", str(steps_file)]
    for item in overrides or []:
        argv += ["--set", item]
    return argv

"""Find and launch the example GRPO trainer (``examples/grpo_trainer.py``) without the core
importing it.

``examples/`` is not an installed package: it lives in the repository (and in the compose
image). It is found in the current directory or in the checkout the ``rollstream`` package
was installed from (editable installs), and run as a child process (:func:`launcher_argv`):
under ``torchrun`` (``python -m torch.distributed.run --standalone --nproc-per-node N
--max-restarts R``) so that a job whose rank died, stalled or failed starts again, up to R
times, resuming after its last committed step; plain ``python`` for one rank without restarts.
"""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPT = Path("examples") / "grpo_trainer.py"
# torchrun's restarts otherwise reuse the rendezvous keys of the failed run and its workers
# cannot connect (pytorch/pytorch#135712); harmless without restarts.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# How often torchrun looks at its workers. The ranks find a lost rank themselves within
# milliseconds (a dead one) or trainer.rank_timeout_seconds (a stalled one) and end with a line
# that names it; a slower look than torchrun's 0.1 s lets them do so before torchrun's SIGTERM.
MONITOR_SECONDS = 0.5


def examples_parent(script: Path = SCRIPT, error: type[Exception] = FileNotFoundError) -> Path:
    """The directory that holds ``script`` (a path under ``examples/``): the current directory or the
    checkout this package runs from; ``error`` saying where it was looked for otherwise."""
    roots = [Path.cwd(), Path(__file__).resolve().parents[2]]
    for root in roots:
        if (root / script).is_file():
            return root
    raise error(f"cannot find {script} (looked in " + ", ".join(str(r) for r in roots)
                + "): run from the repository root, or put the repository on PYTHONPATH")


def launcher_argv(script: str | Path, ranks: int = 1, max_restarts: int = 0) -> list[str]:
    """The command that runs ``script`` as a trainer job of ``ranks`` ranks that ``torchrun``
    restarts up to ``max_restarts`` times (plain ``python`` for one rank without restarts).
    Run it with :data:`TORCHRUN_ENV` in the environment."""
    if ranks < 1 or max_restarts < 0:
        raise ValueError(f"a trainer job needs ranks >= 1 and max_restarts >= 0, not {ranks} and {max_restarts}")
    if ranks == 1 and max_restarts == 0:
        return [sys.executable, str(script)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            f"--max-restarts={max_restarts}", f"--monitor-interval={MONITOR_SECONDS}", str(script)]


def trainer_argv(config_path: str | Path | None, ranks: int = 1, steps_file: Path | None = None,
                 overrides: list[str] | None = None, max_restarts: int = 0) -> list[str]:
    """The command line of the example trainer on ``ranks`` ranks, restarted up to
    ``max_restarts`` times (:func:`launcher_argv`)."""
    argv = [*launcher_argv((examples_parent() / SCRIPT).resolve(), ranks, max_restarts),
            *(["--config", str(config_path)] if config_path else [])]
    if steps_file is not None:
        argv += ["--steps-file", str(steps_file)]
    for item in overrides or []:
        argv += ["--set", item]
    return argv

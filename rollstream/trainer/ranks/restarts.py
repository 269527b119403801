"""Where this process stands among ``torchrun``'s restarts of its job.

``torchrun`` (torch.distributed.elastic) tells each worker which run of the job it belongs to
(``TORCHELASTIC_RESTART_COUNT``: 0 for the first) and how many restarts the job may have
(``TORCHELASTIC_MAX_RESTARTS``). The trainer's log lines say both, so an operator reading one
rank's log knows whether the job will come back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Restarts:
    """``count``: this run's restart number (0: the first run); ``limit``: the most the job may
    have; None when the process does not run under ``torchrun``."""

    count: int = 0
    limit: int | None = None

    @classmethod
    def from_env(cls) -> Restarts:
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            return cls()
        return cls(_int_env("TORCHELASTIC_RESTART_COUNT"), _int_env("TORCHELASTIC_MAX_RESTARTS"))

    @property
    def under_torchrun(self) -> bool:
        return self.limit is not None

    def this_run(self) -> str:
        """E.g. ``restart 1 of at most 3`` or ``first run (at most 3 restarts)``."""
        if self.limit is None:
            return "not under torchrun"
        if self.count == 0:
            return f"first run (at most {self.limit} restart{'s' if self.limit != 1 else ''})"
        return f"restart {self.count} of at most {self.limit}"

    def after_failure(self) -> str:
        """What happens to the job once this run fails."""
        if self.limit is None:
            return "nothing restarts it (not under torchrun)"
        if self.count < self.limit:
            return f"torchrun restarts the job (restart {self.count + 1} of at most {self.limit})"
        return f"torchrun has no restart left ({self.count} of {self.limit} used): the job ends"


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "0") or 0)
    except ValueError:
        return 0

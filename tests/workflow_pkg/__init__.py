"""A workflow package laid out the reference system's way: each name is imported on first use.

``rollout.workflows`` names ``tests.workflow_pkg.MyWorkflow``; importing the package imports
none of its modules (nor torch through them) until a name is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "MyWorkflow": "tests.workflow_pkg.reference_template",
    "ScriptedTemplate": "tests.workflow_pkg.variants",
    "number_reward": "tests.workflow_pkg.reward",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return list(__all__)

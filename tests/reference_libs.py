"""The reference systems' packages the compatibility tests use (areal, verl), with the fix in the
error when they are missing: they are not rollstream dependencies; ``scripts/setup.sh`` installs
the pinned versions (``requirements/areal.txt``, ``requirements/verl.txt``). These tests never
skip: CI runs setup.sh first."""

from __future__ import annotations

import importlib
from types import ModuleType

from rollstream.runtime.import_effects import undo_import_effects


def import_reference(module: str) -> ModuleType:
    """``importlib.import_module(module)``, or ``ImportError`` saying how to install it.

    Import AReaL (and modules that import it) only through this: importing it replaces Python's
    logger hierarchy and installs uvloop's event-loop policy, which are put back at once, before
    the next test module creates its loggers or the session its loop (a uvloop loop idle on its
    sockets never runs pytest-timeout's SIGALRM handler: a hung test would hang the suite)
    (``rollstream.runtime.import_effects``)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{module} is needed by this test and is not installed ({exc}): run `bash scripts/setup.sh`, or "
            "`pip install -r requirements/areal.txt -r requirements/verl.txt && pip install --no-deps areal==1.0.4 "
            "verl==0.9.1` (docs/WORKFLOWS.md#bring-areal-code-unchanged)"
        ) from exc
    finally:
        undo_import_effects()

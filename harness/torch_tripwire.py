"""Run ``rollstream <tier> ...`` in a process that dies loudly the moment torch is imported.

``python -m harness.torch_tripwire grouping --config c.yaml`` is ``rollstream
grouping --config c.yaml`` with a tripwire on the import system: when anything executes the
``torch`` package (an ``import torch`` anywhere, direct, lazy or through another library),
the process prints the importing stack to stderr and exits with :data:`TRIPPED` at once, so
no ``except ImportError`` can hide it. Looking torch up without importing it
(``importlib.util.find_spec("torch")``, as transformers and datasets do to see what is
installed) does not trip it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import traceback
from types import ModuleType


TRIPPED = 86
GUARDED = "torch"


class _TrippingLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        sys.stderr.write(f"TORCH TRIPWIRE: {spec.name} imported from\n{''.join(traceback.format_stack())}")
        sys.stderr.flush()
        os._exit(TRIPPED)

    def exec_module(self, module: ModuleType) -> None:  # pragma: no cover - create_module exits first
        os._exit(TRIPPED)


class _Tripwire(importlib.abc.MetaPathFinder):
    """Finds torch as the other finders do, with a loader that trips instead of loading it."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != GUARDED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _TrippingLoader()
                return spec
        return None


def install() -> None:
    """Arm the tripwire in this process (torch must not be imported yet)."""
    if GUARDED in sys.modules:
        raise RuntimeError("torch is already imported; the tripwire must be installed first")
    sys.meta_path.insert(0, _Tripwire())


if __name__ == "__main__":
    install()
    from rollstream.cli import main

    sys.exit(main(sys.argv[1:]))

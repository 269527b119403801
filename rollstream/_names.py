"""Where the tier packages live, and their old top-level names.

The tiers' code sits in the repository's top-level folders (``producers/``, ``consumers/``,
``rollout_workers/``, ``reward_workers/``) and is installed as ``rollstream.<tier>`` (the package
mapping in ``pyproject.toml``). Two import hooks, installed when ``rollstream`` is imported:

* ``TierFolders`` (last on ``sys.meta_path``): in a source checkout that is not installed
  (``PYTHONPATH=<checkout>``), ``rollstream.producers`` is found in ``<checkout>/producers``. An
  installed package (wheel or editable) is found before it and it never answers.
* ``OldNames``: ``import producers.service`` and the other pre-0.2 names still work for one
  release: they warn (``DeprecationWarning``) and give the SAME module object as the new name,
  never a second copy (two copies would hold two sets of state). ``reward_workers.rewards`` is
  now ``rollstream.rewards``. A top-level ``consumers`` of another distribution wins over it.

Where a checkout's root is on ``sys.path``, Python finds ``producers/`` itself under its old
name: the package's ``__init__`` calls :func:`adopt` and becomes the new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os.path
import sys
import warnings
from types import ModuleType
from typing import Sequence

TIERS = ("producers", "consumers", "rollout_workers", "reward_workers")
MOVED = {"reward_workers.rewards": "rollstream.rewards"}  # modules that left their tier
REMOVAL = "a release after 0.2"


def new_name(old: str) -> str | None:
    """The current name of the pre-0.2 module ``old``, or None when ``old`` is not one."""
    if old in MOVED:
        return MOVED[old]
    if old.split(".", 1)[0] in TIERS:
        return f"rollstream.{old}"
    return None


def _importer_level() -> int:
    """The ``stacklevel`` of the code that wrote the import (past this module and importlib's
    frames), so that the warning names the user's line and Python's default filters show it
    when that line is in ``__main__``."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (frame.f_code.co_filename == __file__ or "importlib" in frame.f_code.co_filename):
        if not _bootstrap(frame.f_code.co_filename):  # warnings itself never counts those
            level += 1
        frame = frame.f_back
    return level


def _bootstrap(filename: str) -> bool:
    return "importlib" in filename and "_bootstrap" in filename


def _warn(old: str, new: str, use: str = "import") -> None:
    warnings.warn(
        f"'{old}' is deprecated and will be removed in {REMOVAL}: {use} '{new}'",
        DeprecationWarning,
        stacklevel=_importer_level(),
    )


class _Existing(importlib.abc.Loader):
    """Loads nothing: hands the import system a module that is already loaded, and puts back
    its own ``__spec__`` (which the import system sets to the old name's on the way)."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module
        self._spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self._module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec


class OldNames(importlib.abc.MetaPathFinder):
    """``producers.x`` -> the module ``rollstream.producers.x``, with a DeprecationWarning.

    Installed twice. Last on ``sys.meta_path`` (``top=True``) it answers the top-level names
    only when no other finder has them, so another distribution's own ``consumers`` package
    is never taken over. First (``top=False``) it answers ``consumers.x`` only when the
    ``consumers`` already imported is ours, so that a submodule is never loaded a second
    time under its old name."""

    def __init__(self, top: bool) -> None:
        self._top = top

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None):
        new = new_name(fullname)
        if new is None or fullname.endswith(".__main__"):
            # `python -m consumers`: runpy must run the tier's __main__.py itself, as __main__
            # (the old package already warned); the path finder finds it through the package
            return None
        parent = fullname.rpartition(".")[0]
        if self._top != (parent == ""):
            return None
        if parent and not _ours(sys.modules.get(parent)):
            return None
        module = importlib.import_module(new)
        _warn(fullname, new)
        spec = importlib.machinery.ModuleSpec(fullname, _Existing(module), is_package=hasattr(module, "__path__"))
        if hasattr(module, "__path__"):
            spec.submodule_search_locations = list(module.__path__)
        return spec


def _ours(module: ModuleType | None) -> bool:
    return module is not None and getattr(module, "__name__", "").startswith("rollstream.")


class TierFolders(importlib.abc.MetaPathFinder):
    """``rollstream.<tier>`` from the checkout's ``<tier>/`` when nothing installed it."""

    def __init__(self, checkout: str) -> None:
        self._checkout = checkout

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None):
        prefix, _, tier = fullname.partition(".")
        if prefix != "rollstream" or tier not in TIERS:
            return None
        init = os.path.join(self._checkout, tier, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[os.path.dirname(init)])


def adopt(name: str) -> None:
    """Called by each tier's ``__init__``: under an old top-level name, warn and become the new
    module (the import then returns it); under the new name, nothing."""
    new = new_name(name)
    if new is None or new == name:
        return
    _warn(name, new)
    sys.modules[name] = importlib.import_module(new)


def warn_if_run_by_old_name(spec: importlib.machinery.ModuleSpec | None) -> None:
    """Called by each tier's ``__main__``: ``python -m consumers`` warns in the running script
    (the package's own warning went to runpy, which Python's default filters hide)."""
    name = spec.name if spec is not None else ""
    new = new_name(name)
    if new is not None and new != name:
        _warn(name.removesuffix(".__main__"), new.removesuffix(".__main__"), use="run python -m")


def install() -> None:
    """Put both hooks in place once per process."""
    if any(isinstance(f, OldNames) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, OldNames(top=False))
    sys.meta_path.append(OldNames(top=True))
    # os.path, not pathlib: an installed .pth imports this module in every interpreter start
    sys.meta_path.append(TierFolders(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

"""Import strings from configuration (``pkg.module.name`` or ``pkg.module:Outer.name``).

Only configuration names code to import; messages never do (see the workflow allow-list).
Code imported here may replace Python's logger hierarchy or the event-loop policy (AReaL's
modules do both); they are put back at once (``rollstream.runtime.import_effects``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rollstream.config import ConfigError
from rollstream.runtime.import_effects import undo_import_effects

# Modules of rollstream that configuration may name and that moved: an import string naming one
# is refused with the new name, as a moved config key is.
MOVED_MODULES = {"rollstream.consumers.group_filters": "rollstream.consumers.grouping.filters"}


def import_object(path: str) -> Any:
    """The object ``path`` names. ``ValueError`` for a malformed string, ``ImportError``
    (naming ``path``) when the module or attribute does not exist."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"import string {path!r} must look like 'pkg.module.name' or 'pkg.module:name'")
    if module_name in MOVED_MODULES:
        raise ImportError(f"cannot import {path!r}: the module is {MOVED_MODULES[module_name]} ('{MOVED_MODULES[module_name]}:{attr}')")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import {path!r}: {exc}") from exc
    finally:
        undo_import_effects()  # before anything else creates a logger (AReaL replaces the hierarchy)
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ImportError(f"cannot import {path!r}: module {module_name!r} has no {attr!r}") from None
    return obj


def import_callable(path: str, setting: str) -> Callable[..., Any]:
    """The callable ``path`` names for the configuration ``setting``; :class:`ConfigError`
    naming the setting and the string when it is malformed, cannot be imported or is not callable."""
    try:
        target = import_object(path)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"invalid configuration: {setting} {path!r}: {exc}") from None
    if not callable(target):
        raise ConfigError(f"invalid configuration: {setting} {path!r} is not callable")
    return target

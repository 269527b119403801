"""What importing a library may change for the whole process, put back at once.

AReaL's modules change two process-wide settings when imported: ``areal.utils.logging``
replaces Python's logger hierarchy (``rollstream.runtime.logs.restore_standard_logging``), and
``areal.api.cli_args`` calls ``uvloop.install()``, making every event loop created afterwards a
uvloop loop. Neither is the user's choice: the first hides rollstream's log lines, the second
changes how later loops handle signals (a uvloop loop waiting on its sockets runs no Python
signal handler, so SIGALRM-based timeouts and alarms never fire). :func:`undo_import_effects`
restores both; it is called wherever configured or reference code is imported and around
AReaL episodes. A policy set before rollstream was imported is the one kept.
"""

from __future__ import annotations

import asyncio
import logging
import warnings

from rollstream.runtime.logs import restore_standard_logging

log = logging.getLogger(__name__)


def _current_policy() -> asyncio.AbstractEventLoopPolicy:
    with warnings.catch_warnings():  # the policy API is deprecated from Python 3.14
        warnings.simplefilter("ignore", DeprecationWarning)
        return asyncio.get_event_loop_policy()


_POLICY = _current_policy()
_warned = False


def restore_event_loop_policy() -> bool:
    """Put back the event-loop policy the process had when rollstream was imported; True when
    an import had replaced it."""
    global _warned
    if _current_policy() is _POLICY:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncio.set_event_loop_policy(_POLICY)
    if not _warned:
        _warned = True
        log.warning("a library replaced the asyncio event-loop policy (AReaL installs uvloop when imported); "
                    "restored it, so loops created later behave as before the import")
    return True


def undo_import_effects() -> None:
    """Restore what importing a library changed process-wide: the logger hierarchy and the
    event-loop policy."""
    restore_standard_logging()
    restore_event_loop_policy()

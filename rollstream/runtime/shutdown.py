"""Graceful shutdown: the first SIGTERM/SIGINT asks the tier to stop, a second exits at once."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

log = logging.getLogger(__name__)

FORCED_EXIT_CODE = 130


class ShutdownSignal:
    """Owns an ``asyncio.Event`` that a tier's loop watches; installed on the running loop."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._count = 0

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self._count += 1
        if self._count == 1:
            log.info("%s received: finishing in-flight work, then exiting", sig.name)
            self.event.set()
        else:
            log.warning("%s received again: exiting now", sig.name)
            os._exit(FORCED_EXIT_CODE)

    def is_set(self) -> bool:
        return self.event.is_set()

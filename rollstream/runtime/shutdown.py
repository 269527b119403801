"""Graceful shutdown: the first SIGTERM/SIGINT asks the tier to stop, a second exits at once,
and a tier still running ``exit_after`` seconds after the first exits then (code 124), even
when its event loop is stuck: the clock is a thread of its own."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

FORCED_EXIT_CODE = 130
SHUTDOWN_TIMEOUT_EXIT_CODE = 124


class ShutdownSignal:
    """Owns an ``asyncio.Event`` that a tier's loop watches; installed on the running loop."""

    def __init__(self, exit_after: float | None = None) -> None:
        self.event = asyncio.Event()
        self._count = 0
        self._exit_after = exit_after
        self._clock: threading.Timer | None = None

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self._count += 1
        if self._count == 1:
            log.info("%s received: finishing in-flight work, then exiting", sig.name)
            self.event.set()
            self._start_clock()
        else:
            log.warning("%s received again: exiting now", sig.name)
            os._exit(FORCED_EXIT_CODE)

    def _start_clock(self) -> None:
        if self._exit_after is None:
            return
        self._clock = threading.Timer(self._exit_after, _exit_now, (self._exit_after,))
        self._clock.daemon = True
        self._clock.start()

    def cancel(self) -> None:
        """The tier ended: no forced exit."""
        if self._clock is not None:
            self._clock.cancel()

    def is_set(self) -> bool:
        return self.event.is_set()


def _exit_now(seconds: float) -> None:
    log.error("still running %.0f s after the stop was asked (its shutdown bound): exiting now", seconds)
    logging.shutdown()
    os._exit(SHUTDOWN_TIMEOUT_EXIT_CODE)

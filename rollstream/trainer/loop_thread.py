"""An asyncio event loop on a background thread, for synchronous callers of async clients.

The Kafka and Redis clients are asyncio; a synchronous trainer loop blocks its thread for a
whole step. Running the clients' loop on a thread of its own keeps their heartbeats and
polls going while the trainer's thread computes (a step of any length keeps the consumer in
its consumer group), and :meth:`LoopThread.run` hands a coroutine over and waits for its result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from rollstream.runtime.tasks import cancel_and_wait

T = TypeVar("T")


class LoopThread:
    """A daemon thread running one event loop until :meth:`close`."""

    def __init__(self, name: str = "rollstream-trainer-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and return its result (its exception is raised here).

        ``timeout`` bounds the wait (``TimeoutError``; the coroutine is cancelled)."""
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the trainer's I/O thread is not running (closed?)")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no result within {timeout}s") from None
        except KeyboardInterrupt:
            future.cancel()  # Ctrl-C in the trainer's thread: do not leave the call running
            raise

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what still runs on the loop, stop it and join the thread."""
        if not self._thread.is_alive():
            return

        async def cancel_all() -> None:
            await cancel_and_wait(*(t for t in asyncio.all_tasks() if t is not asyncio.current_task()))

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()

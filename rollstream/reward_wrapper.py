"""Run synchronous reward functions in a shared process pool, with timeouts and retries.

Semantics follow the reference system: each attempt runs under ``asyncio.wait_for(timeout)``;
there are ``max_retries`` retries after the first attempt; a timeout on the last attempt yields
the float 0.0 (logged); a broken pool is rebuilt and the call retried, re-raising after the last
attempt; any other exception is retried and then re-raised.

Better than the reference: a call that times out while running keeps its worker process busy
forever, and enough such calls would take every worker. So when a running call times out, the
pool is rebuilt: its worker processes are terminated and a fresh pool is started on next use.
Other calls in flight on the terminated pool fail with ``BrokenProcessPool`` and are retried
like any broken-pool failure (this uses one of their attempts).

A broken pool breaks every call in flight on it, not only the one whose function killed its
worker (``os._exit``, a segfault, the OOM killer). So a call that met a broken shared pool runs
its next attempts ISOLATED: alone in a one-process pool (one of ``max_workers`` isolation
slots, so a hanging isolated call holds up only its own slot). There a break can only be its
own fault. A broken shared pool never ends a call: when it
happens on the last attempt, the call still gets one isolated attempt. Innocent neighbours of a
poisonous reward function therefore get their rewards; only the culprit fails.

Workers are started with "forkserver" (or "spawn" where that is missing), never "fork":
forking a process that holds torch and its threads is unsafe.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import inspect
import logging
import multiprocessing
import os
import pickle
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures.process import BrokenProcessPool
from contextvars import ContextVar
from typing import Any

logger = logging.getLogger(__name__)

START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"

# The isolation slot the current call's attempt runs in, None for the shared pool (see the module
# docstring). A context variable rather than an argument, so subclasses overriding
# ``_attempt(args, kwargs)`` keep working.
_isolation_slot: ContextVar[int | None] = ContextVar("reward_isolation_slot", default=None)


class _SharedPool:
    """One lazily started process pool, shared by every wrapper that asks for its size, plus
    as many one-process isolation slots as the pool has workers."""

    def __init__(self, max_workers: int | None) -> None:
        self.max_workers = max_workers
        self.refcount = 0
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        slots = max(1, max_workers or os.cpu_count() or 1)
        self._slots: list[concurrent.futures.ProcessPoolExecutor | None] = [None] * slots
        self._lock = threading.Lock()
        # free slot numbers, per event loop (asyncio queues belong to one loop)
        self._free: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Queue[int]] = (
            weakref.WeakKeyDictionary()
        )

    def executor(self, slot: int | None = None) -> concurrent.futures.ProcessPoolExecutor:
        """The shared executor, or the one-process executor of isolation slot ``slot``."""
        with self._lock:
            if slot is not None:
                executor = self._slots[slot]
                if executor is None:
                    executor = self._slots[slot] = _new_executor(1)
                return executor
            if self._executor is None:
                self._executor = _new_executor(self.max_workers)
            return self._executor

    @contextlib.asynccontextmanager
    async def isolation_slot(self) -> AsyncIterator[int]:
        """A slot no other call uses until the block ends (waits for one to be free)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            free = self._free.get(loop)
            if free is None:
                free = self._free[loop] = asyncio.Queue()
                for slot in range(len(self._slots)):
                    free.put_nowait(slot)
        slot = await free.get()
        try:
            yield slot
        finally:
            free.put_nowait(slot)

    def rebuild(self, old: concurrent.futures.ProcessPoolExecutor) -> None:
        """Retire ``old`` (killing its workers) unless another caller already replaced it."""
        with self._lock:
            if self._executor is old:
                self._executor = None
                which = f"reward process pool (max_workers={self.max_workers})"
            elif old in self._slots:
                slot = self._slots.index(old)
                self._slots[slot] = None
                which = f"isolated reward process (slot {slot})"
            else:
                return
        logger.warning("rebuilding %s", which)
        _terminate(old)

    def shutdown(self) -> None:
        with self._lock:
            old = [e for e in (self._executor, *self._slots) if e is not None]
            self._executor = None
            self._slots = [None] * len(self._slots)
        for executor in old:
            _terminate(executor)


def _new_executor(max_workers: int | None) -> concurrent.futures.ProcessPoolExecutor:
    return concurrent.futures.ProcessPoolExecutor(
        max_workers=max_workers, mp_context=multiprocessing.get_context(START_METHOD)
    )


def _terminate(executor: concurrent.futures.ProcessPoolExecutor) -> None:
    # ProcessPoolExecutor (before 3.14) has no public way to stop a busy worker; killing the
    # processes makes the pool fail every pending call with BrokenProcessPool, which callers retry.
    processes = getattr(executor, "_processes", None) or {}
    for proc in list(processes.values()):
        if proc.is_alive():
            proc.terminate()
    executor.shutdown(wait=False)


_pools: dict[int | None, _SharedPool] = {}
_pools_lock = threading.Lock()


def _acquire(max_workers: int | None) -> _SharedPool:
    with _pools_lock:
        pool = _pools.setdefault(max_workers, _SharedPool(max_workers))
        pool.refcount += 1
        return pool


def _release(pool: _SharedPool) -> None:
    with _pools_lock:
        pool.refcount -= 1
        if pool.refcount > 0:
            return
        _pools.pop(pool.max_workers, None)
    pool.shutdown()


@atexit.register
def _shutdown_all() -> None:
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.shutdown()


def _check_picklable(reward_fn: Callable[..., Any]) -> None:
    if inspect.iscoroutinefunction(reward_fn):
        raise TypeError("AsyncRewardWrapper runs synchronous reward functions; await an async one directly")
    try:
        pickle.dumps(reward_fn)
    except Exception as exc:
        raise TypeError(
            f"reward function {reward_fn!r} cannot be pickled: reward functions run in worker "
            "processes and must be picklable (module-level functions, not lambdas or local functions)"
        ) from exc


class AsyncRewardWrapper:
    """Awaitable wrapper around a picklable, synchronous ``reward_fn`` returning a number.

    ``await wrapper(*args, **kwargs)`` returns ``float(reward_fn(*args, **kwargs))``, 0.0 when
    the last attempt timed out, or raises the last error. Arguments must pickle too.
    Wrappers with the same ``max_workers`` share one pool; call :meth:`aclose` when done (the
    pool is shut down when its last wrapper closes, or at interpreter exit).
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        timeout_seconds: float = 15.0,
        max_retries: int = 3,
        max_workers: int | None = None,
    ) -> None:
        _check_picklable(reward_fn)
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.reward_fn = reward_fn
        self.timeout_seconds = timeout_seconds
        self.max_retries = max_retries
        self._pool: _SharedPool | None = _acquire(max_workers)

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        attempts = self.max_retries + 1
        isolated = False
        attempt = 0
        while True:
            attempt += 1
            last = attempt >= attempts
            try:
                if isolated:
                    async with self._require_pool().isolation_slot() as slot:
                        token = _isolation_slot.set(slot)
                        try:
                            return await self._attempt(args, kwargs)
                        finally:
                            _isolation_slot.reset(token)
                return await self._attempt(args, kwargs)
            except TimeoutError:
                if last:
                    logger.warning(
                        "reward function %s timed out after %s s on all %d attempts; reward 0.0",
                        self._name, self.timeout_seconds, attempt,
                    )
                    return 0.0
                logger.warning("reward function %s timed out (attempt %d/%d)", self._name, attempt, attempts)
            except BrokenProcessPool:
                if isolated and last:
                    raise  # it broke a pool it had to itself: its own fault
                if not isolated:
                    # maybe another call's fault: go on alone, with at least one more attempt
                    isolated = True
                    attempts = max(attempts, attempt + 1)
                logger.warning(
                    "reward pool broken during %s (attempt %d/%d); retrying it isolated",
                    self._name, attempt, attempts,
                )
            except Exception as exc:
                if last:
                    raise
                logger.warning("reward function %s raised %r (attempt %d/%d)", self._name, exc, attempt, attempts)

    async def _attempt(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
        pool = self._require_pool()
        executor = pool.executor(_isolation_slot.get())
        try:
            cfut = executor.submit(self.reward_fn, *args, **kwargs)
        except BrokenProcessPool:
            pool.rebuild(executor)
            raise
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(cfut), self.timeout_seconds)
        except TimeoutError:
            # A call still queued was simply cancelled; a running one holds its worker hostage.
            if not cfut.cancel() and not cfut.done():
                pool.rebuild(executor)
            raise
        except BrokenProcessPool:
            pool.rebuild(executor)
            raise
        return float(result)

    def _require_pool(self) -> _SharedPool:
        if self._pool is None:
            raise RuntimeError("AsyncRewardWrapper is closed")
        return self._pool

    @property
    def _name(self) -> str:
        return getattr(self.reward_fn, "__qualname__", repr(self.reward_fn))

    async def aclose(self) -> None:
        """Release this wrapper's share of the pool; further calls raise ``RuntimeError``."""
        pool, self._pool = self._pool, None
        if pool is not None:
            _release(pool)


async def close_workflow(workflow: Any) -> None:
    """Release what a workflow holds: its own ``aclose`` if it has one, then every
    ``AsyncRewardWrapper`` it keeps as an attribute (workflows written for the reference system
    create one and never close it, so its share of the process pool would outlive them).
    Closing a wrapper twice is harmless. Raises the first error after trying them all."""
    closers = [getattr(workflow, "aclose", None)]
    closers += [v.aclose for v in getattr(workflow, "__dict__", {}).values() if isinstance(v, AsyncRewardWrapper)]
    errors: list[BaseException] = []
    for close in closers:
        if close is None:
            continue
        try:
            await close()
        except Exception as exc:  # noqa: BLE001 - the others must still be closed
            errors.append(exc)
    if errors:
        raise errors[0]

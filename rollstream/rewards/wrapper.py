"""Run synchronous reward functions in worker processes, with timeouts and retries.

Semantics follow AReaL's ``AsyncRewardWrapper``: each attempt has a
timeout (``timeout_seconds``); there are ``max_retries`` retries after the first attempt; a
timeout on the last attempt yields the float 0.0 (logged); any other failure (the function's
exception, or ``BrokenProcessPool`` when the worker process running the call died) is retried
and then re-raised. :meth:`AsyncRewardWrapper.call` is the same call without the 0.0: a
timeout on the last attempt raises :class:`~rollstream.rewards.pool.RewardTimeout`, so a
caller with its own policy (the reward tier's ``reward.on_timeout``) can tell it from a
genuine 0.0 reward; ``await wrapper(...)`` catches it at this boundary.

The processes are a :class:`rollstream.rewards.pool.RewardPool` (its docstring says what a
call may rely on): concurrent calls leave in one chunk per worker process rather than one
executor task each (bench/README.md), a timeout counts from the moment the call starts
running, and only the call that hangs or kills its process fails; retries run alone.
"""

from __future__ import annotations

import atexit
import inspect
import itertools
import logging
import pickle
import threading
from collections.abc import Callable
from typing import Any

from rollstream.retry import REWARD_RETRY
from rollstream.rewards.pool import START_METHOD, RewardPool, RewardTimeout

__all__ = ["START_METHOD", "AsyncRewardWrapper", "RewardTimeout", "close_workflow"]

logger = logging.getLogger(__name__)

_pools: dict[int | None, RewardPool] = {}
_pools_lock = threading.Lock()


def _acquire(max_workers: int | None) -> RewardPool:
    with _pools_lock:
        pool = _pools.setdefault(max_workers, RewardPool(max_workers))
        pool.refcount += 1
        return pool


def _release(pool: RewardPool) -> None:
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
    the last attempt timed out, or raises the last error; :meth:`call` raises
    ``RewardTimeout`` instead of that 0.0. Arguments must pickle too.
    Wrappers with the same ``max_workers`` share one pool (``max_workers`` processes for each
    event loop that calls); call :meth:`aclose` when done (the pool is shut down when its last
    wrapper closes, or at interpreter exit).
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
        self._pool: RewardPool | None = _acquire(max_workers)

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        try:
            return await self.call(*args, **kwargs)
        except RewardTimeout as exc:
            logger.warning("%s; reward 0.0", exc)
            return 0.0

    async def call(self, *args: Any, **kwargs: Any) -> float:
        """The reward; raises ``RewardTimeout`` when every attempt timed out, else the last
        attempt's error."""
        attempts = self.max_retries + 1
        blob = pickle.dumps((self.reward_fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        tries = itertools.count(1)

        async def attempt() -> float:
            if self._pool is None:
                raise RuntimeError("AsyncRewardWrapper is closed")
            # a retry runs alone: a call that failed once may hang or kill its process again
            return await self._pool.run(blob, self._name, self.timeout_seconds, alone=next(tries) > 1)

        try:
            return await REWARD_RETRY.limited(max_attempts=attempts).call(
                attempt, retry_on=(Exception,), what=f"reward function {self._name}")
        except RewardTimeout:
            raise RewardTimeout(
                f"reward function {self._name} timed out after {self.timeout_seconds} s on all {attempts} attempts"
            ) from None

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
    ``AsyncRewardWrapper`` it keeps as an attribute (workflows written for AReaL
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

"""The one retry policy: capped exponential backoff with jitter, from tenacity.

Every tier waits the same way for what may come back (a broker restarting, a coordinator
moving, Redis down, a transaction that failed): ``RetryPolicy`` holds the numbers and the
wait strategy is tenacity's ``wait_exponential_jitter``, so no module writes its own delay
math. Two shapes of use:

- a call that is simply retried: ``await policy.call(fn, retry_on=(...), what="...")``;
- a loop that keeps running and only needs to know how long to pause after its N-th failure
  in a row (the transactional loops, which rebuild their state between tries): a
  :class:`Backoff` from ``policy.backoff()``; ``failed()`` returns the pause and raises
  :class:`RetriesExhausted` once ``max_attempts`` failures came in a row, ``succeeded()``
  resets it.

``patience`` is how long an outage is waited out (``kafka.outage_patience_seconds`` for the
tiers): with it, the policy never gives up before the failures in a row have gone on for
that many seconds, however many tries that is; with ``max_attempts`` as well, both must be
reached (a fault that answers at once cannot end a tier sooner than an outage would).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import tenacity

log = logging.getLogger(__name__)

T = TypeVar("T")


class RetriesExhausted(RuntimeError):
    """The policy gave up (tries and patience spent); ``__cause__`` is the last error."""


@dataclass(frozen=True)
class RetryPolicy:
    """Pauses of ``initial * 2**(n-1)`` seconds (plus up to ``jitter``), at most ``maximum``.

    Giving up: after ``max_attempts`` tries in a row AND ``patience`` seconds of failing in a
    row, each limit counting only when set; neither set: never (a service waiting for a
    dependency).
    """

    initial: float = 0.25
    maximum: float = 5.0
    jitter: float = 0.25
    max_attempts: int | None = None
    patience: float | None = None

    def limited(self, max_attempts: int | None = None, patience: float | None = None) -> RetryPolicy:
        """The same pauses, giving up after ``max_attempts`` tries and ``patience`` seconds."""
        return dataclasses.replace(self, max_attempts=max_attempts, patience=patience)

    @property
    def gives_up(self) -> bool:
        return self.max_attempts is not None or self.patience is not None

    def wait_strategy(self) -> tenacity.wait.wait_base:
        return tenacity.wait_exponential_jitter(multiplier=self.initial, max=self.maximum, jitter=self.jitter)

    def backoff(self, clock: Callable[[], float] = time.monotonic) -> Backoff:
        return Backoff(self, clock)

    def pause(self, failures: int) -> float:
        """The pause after the ``failures``-th failure in a row (1 = the first)."""
        state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = max(1, failures)
        return float(self.wait_strategy()(state))

    async def call(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        retry_on: tuple[type[BaseException], ...] | Callable[[BaseException], bool],
        what: str,
        stop: asyncio.Event | None = None,
    ) -> T:
        """``await fn()``, retried on ``retry_on`` (exception types, or a predicate) with this
        policy's pauses (each logged, naming ``what``).

        Raises the last error once the policy gives up (``max_attempts`` tries and ``patience``
        seconds, each when set), or at once when ``stop`` is set.
        """
        limits: list[tenacity.stop.stop_base] = []
        if self.max_attempts is not None:
            limits.append(tenacity.stop_after_attempt(self.max_attempts))
        if self.patience is not None:
            limits.append(tenacity.stop_after_delay(self.patience))
        stops: list[tenacity.stop.stop_base] = [tenacity.stop_all(*limits)] if limits else []
        if stop is not None:
            stops.append(tenacity.stop_when_event_set(stop))  # typed for threading.Event; it only calls is_set()
        retrying = tenacity.AsyncRetrying(
            retry=(
                tenacity.retry_if_exception_type(retry_on)
                if isinstance(retry_on, tuple) else tenacity.retry_if_exception(retry_on)
            ),
            wait=self.wait_strategy(),
            stop=tenacity.stop_any(*stops) if stops else tenacity.stop_never,
            before_sleep=_log_retry(what),
            reraise=True,
        )
        async def invoke() -> T:  # tenacity awaits only coroutine functions, not lambdas
            return await fn()

        return await retrying(invoke)


class Backoff:
    """Failures in a row -> the pause before the next try (see the module docstring)."""

    def __init__(self, policy: RetryPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.failures = 0
        self._clock = clock
        self._since = 0.0  # when the first failure of the current run came

    @property
    def next_pause(self) -> float:
        """About how long the next failure will pause (for log lines)."""
        return self.policy.pause(self.failures + 1)

    @property
    def failing_for(self) -> float:
        """Seconds since the first failure in a row (0 when the last try succeeded)."""
        return self._clock() - self._since if self.failures else 0.0

    def failed(self, error: BaseException | None = None) -> float:
        """Count one more failure; the seconds to pause, or RetriesExhausted past the limit."""
        self.failures += 1
        if self.failures == 1:
            self._since = self._clock()
        policy = self.policy
        tries_spent = policy.max_attempts is None or self.failures >= policy.max_attempts
        patience_spent = policy.patience is None or self.failing_for >= policy.patience
        if policy.gives_up and tries_spent and patience_spent:
            raise RetriesExhausted(
                f"{self.failures} tries in a row failed, last: {error!r} (failing for {self.failing_for:.0f}s)"
            ) from error
        return self.policy.pause(self.failures)

    async def sleep(self, error: BaseException | None = None) -> None:
        """Count a failure and pause for it."""
        await asyncio.sleep(self.failed(error))

    def succeeded(self) -> None:
        self.failures = 0


def _log_retry(what: str) -> Callable[[tenacity.RetryCallState], None]:
    def before_sleep(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        pause = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning(
            "%s failed (try %d: %s: %s); retrying in %.1fs",
            what, state.attempt_number, type(error).__name__, error, pause,
        )

    return before_sleep


# The named policies; every retry in rollstream uses one of them (limits set per use with
# ``limited``), or numbers its user set in the config (``rollout.server.backoff_*``).
KAFKA_RETRY = RetryPolicy(initial=0.25, maximum=5.0, jitter=0.25)  # a broker restarting, a coordinator moving, a failed transaction
REDIS_RETRY = RetryPolicy(initial=0.2, maximum=5.0, jitter=0.25)  # Redis down or restarting
# following the trainer's weights: the version store unreachable, a weight load, an engine's
# resume or a server's weight sync that failed
WEIGHTS_RETRY = RetryPolicy(initial=0.5, maximum=30.0, jitter=0.0)
# a reward function that raised or timed out: tried again at once, as AReaL's wrapper does
REWARD_RETRY = RetryPolicy(initial=0.0, maximum=0.0, jitter=0.0)


def transaction_retry(max_attempts: int, patience: float | None = None) -> RetryPolicy:
    """The policy of the transactional loops: :data:`KAFKA_RETRY`, giving up after
    ``max_attempts`` failures in a row that went on for ``patience`` seconds."""
    return KAFKA_RETRY.limited(max_attempts, patience)

"""A small statistics tracker for rollout code (AReaL's ``stats_tracker``).

Keys are prefixed at record time with the episode's ``workflow_context.stat_scope()``
("rollout" or "eval-rollout") and then with the names of the enclosing :meth:`StatsTracker.scope`
blocks, e.g. ``rollout/reward`` or ``eval-rollout/agent/turns``. Scopes live in a context
variable, so concurrently running episodes never see each other's scope names.

``export()`` yields, per recorded key, ``<key>/mean``, ``<key>/min``, ``<key>/max`` and
``<key>/count``; per counter, ``<key>`` with its total. ``totals()`` gives the same keys' sums
and counts since the tracker was made, never reset: what the rollout worker's metrics endpoint
serves for :data:`stats_tracker` (``rollstream.runtime.metrics``: ``rollstream_workflow_stat`` and
``rollstream_workflow_count_total``, labelled by key).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from rollstream.api.context import workflow_context

_scopes: ContextVar[tuple[str, ...]] = ContextVar("rollstream_stat_scopes", default=())


@dataclass
class _Summary:
    """Running aggregate of one key: constant memory however many values are recorded."""

    total: float = 0.0
    count: int = 0
    min: float = math.inf
    max: float = -math.inf

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1
        self.min = min(self.min, value)
        self.max = max(self.max, value)

    def add_many(self, total: float, count: int) -> None:
        """``count`` values summing to ``total`` (their min and max: taken as their mean)."""
        self.total += total
        self.count += count
        mean = total / count
        self.min = min(self.min, mean)
        self.max = max(self.max, mean)


class StatsTracker:
    """Records numeric values and counters; safe to call from asyncio tasks and threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._summaries: dict[str, _Summary] = {}
        self._counters: dict[str, float] = {}
        # since the start, for the metrics endpoint: ``export(reset=True)`` leaves them alone
        self._sums: dict[str, tuple[float, int]] = {}
        self._counts: dict[str, float] = {}

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix keys recorded inside the block with ``name`` (nests)."""
        if not name or "/" in name:
            raise ValueError(f"scope name must be non-empty and contain no '/': {name!r}")
        token = _scopes.set((*_scopes.get(), name))
        try:
            yield
        finally:
            _scopes.reset(token)

    def _key(self, name: str) -> str:
        return "/".join((workflow_context.stat_scope(), *_scopes.get(), name))

    def record(self, **values: float) -> None:
        """Add one observation per keyword; ``TypeError`` for non-numeric values."""
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                value = _as_float(name, value)
            key, value = self._key(name), float(value)
            with self._lock:
                self._summaries.setdefault(key, _Summary()).add(value)
                total, count = self._sums.get(key, (0.0, 0))
                self._sums[key] = (total + value, count + 1)

    def absorb(self, key: str, total: float, count: int) -> None:
        """Add ``count`` values summing to ``total`` under ``key`` as it is (already scoped):
        statistics reduced elsewhere (AReaL's tracker, ``rollstream.areal.stats``)."""
        if count <= 0:
            return
        with self._lock:
            self._summaries.setdefault(key, _Summary()).add_many(float(total), int(count))
            old_total, old_count = self._sums.get(key, (0.0, 0))
            self._sums[key] = (old_total + float(total), old_count + int(count))

    def increment(self, name: str, by: float = 1) -> None:
        """Add ``by`` to the counter ``name``."""
        key = self._key(name)
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + by
            self._counts[key] = self._counts.get(key, 0) + by

    def export(self, reset: bool = True) -> dict[str, float]:
        """All statistics as a flat dict; with ``reset`` the tracker starts empty again."""
        with self._lock:
            summaries, counters = self._summaries, self._counters
            if reset:
                self._summaries, self._counters = {}, {}
            out: dict[str, float] = {k: float(v) for k, v in counters.items()}
            for key, s in summaries.items():
                out[f"{key}/mean"] = s.total / s.count
                out[f"{key}/min"] = s.min
                out[f"{key}/max"] = s.max
                out[f"{key}/count"] = float(s.count)
        return out


    def totals(self) -> tuple[dict[str, tuple[float, int]], dict[str, float]]:
        """``({key: (sum, count)} of recorded values, {key: total} of counters)`` since the
        tracker was made (``export`` does not reset them)."""
        with self._lock:
            return dict(self._sums), dict(self._counts)


def _as_float(name: str, value: object) -> float:
    """Accept bools and 0-dim numeric objects (numpy scalars, one-element tensors)."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise TypeError(f"stat {name!r} must be numeric, got {type(value).__name__}") from exc


stats_tracker = StatsTracker()
"""The process-wide default tracker that built-in workflows record into."""

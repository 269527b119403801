"""Which policy versions wrote a trajectory, and how far behind the trainer that is.

THE computation of a row's head and tail version and of staleness; every tier calls these
functions and nothing else computes them. Accepts numpy arrays and torch tensors (read as
numpy, without importing torch here: the grouping and dump tiers never import torch).

The rule (DECISION): staleness is about the tokens the trainer learns from, so versions count
only on **generated positions**:

- attended (``attention_mask`` true; every position without an attention mask);
- generated: ``loss_mask == 1``. A multi-turn row whose earlier model turns carry
  ``loss_mask`` 0 (not trained on) but versions ``>= 0`` does not count those turns. Without a
  loss mask, the positions whose version is ``>= 0`` (prompts carry -1 by contract); without
  either, nothing tells prompt from answer and the whole row counts as prompt;
- known: a version of ``-1`` on a generated position is "unknown" and left out. Where a row
  has generated positions but no known version (no ``versions`` tensor, or all -1), the
  caller's ``fallback_version`` stands for them: the rollout worker passes its engine's
  version when the episode ended (AReaL's fallback), which is the only place
  that knows it. The grouping tier combines the episodes' spans (:func:`head_and_tail`)
  instead of reading the tokens again, so the episode, its group's staleness filter, its emitted
  record and the dump agree; the trainer reads its tensors with these same functions (without a
  fallback, so only tokens versioned by it can differ).

``head`` is the oldest known version, ``tail`` the newest; ``-1`` (:data:`PROMPT_VERSION`)
when there is none. Staleness is ``trainer_version - head`` (0 without a head), with the
trainer version never below the tail (:func:`group_trainer_version`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Protocol

import numpy

PROMPT_VERSION = -1  # version of prompt positions, of padding, and of "unknown"


class Versioned(Protocol):
    """Anything with a head and tail version: a :class:`RowSpan`, :class:`Versions`, an
    ``Episode`` message."""

    @property
    def head_version(self) -> int: ...

    @property
    def tail_version(self) -> int: ...


class Versions(NamedTuple):
    """Oldest and newest known version over generated positions; -1 when none."""

    head_version: int
    tail_version: int


class RowSpan(NamedTuple):
    """Where a row's answer lies and which policy versions wrote it (see :func:`row_spans`)."""

    seqlen: int  # attended positions (padding excluded)
    prompt_len: int  # attended positions before the first generated one; seqlen when none
    head_version: int  # oldest known version over generated positions; -1 when none generated
    tail_version: int  # newest


def row_spans(td: Mapping[str, Any], fallback_version: int = PROMPT_VERSION) -> list[RowSpan]:
    """The :class:`RowSpan` of every row of a ``[B, L]`` trajectory dict (arrays or tensors),
    by the rule of the module docstring. ``prompt_len`` is the number of attended positions
    before the first generated one (AReaL's ``seqlen - sum(loss_mask)`` is wrong for
    multi-turn rows); a row with no generated position gets ``(-1, -1)``; a row with generated
    positions of no known version (or without any way to tell them) gets ``fallback_version``
    for both."""
    rows, length = td["input_ids"].shape[:2]
    mask = td.get("attention_mask")
    attended = numpy.ones((rows, length), dtype=bool) if mask is None else _as_array(mask).astype(bool, copy=False)
    loss = _optional_array(td.get("loss_mask"))
    versions = _optional_array(td.get("versions"))
    return [
        _row_span(attended[r], None if loss is None else loss[r], None if versions is None else versions[r],
                  fallback_version)
        for r in range(rows)
    ]


def head_and_tail(spans: Iterable[Versioned]) -> Versions:
    """THE head and tail of several spans (rows, episodes, groups): the oldest known head and
    the newest known tail; ``(-1, -1)`` when none is known. Combining spans gives what the
    tokens give (a min of mins), so a group's versions are its episodes' combined."""
    heads: list[int] = []
    tails: list[int] = []
    for span in spans:
        if span.head_version >= 0:
            heads.append(span.head_version)
        if span.tail_version >= 0:
            tails.append(span.tail_version)
    return Versions(min(heads, default=PROMPT_VERSION), max(tails, default=PROMPT_VERSION))


def staleness(trainer_version: int, head_version: int) -> int:
    """THE staleness of data whose oldest generated token has ``head_version``, trained on by
    ``trainer_version``: how many versions behind it is; 0 without a known head. Pass the
    trainer version the data is tagged with (:func:`group_trainer_version`), never less."""
    return trainer_version - head_version if head_version >= 0 else 0


def token_staleness(trainer_version: int, versions: Any, loss_mask: Any) -> numpy.ndarray:
    """THE staleness (:func:`staleness`) of every generated token of known version of a
    ``[B, L]`` batch (arrays or tensors): ``loss_mask`` 1 and version ``>= 0``; flat, row by row."""
    known = _as_array(versions)
    generated = (_as_array(loss_mask) == 1) & (known >= 0)
    return trainer_version - known[generated].astype(numpy.int64)


def group_trainer_version(trainer_version: int, tail_version: int) -> int:
    """The trainer version data is tagged with: the one known (read from Redis) or its newest
    token's, whichever is newer. A version is published before any token of it is generated,
    so a tail above the version read proves the trainer was at least there (Redis failed,
    lagged or lost the version). The staleness filter and the emitted group use this same value, so a
    group that passes the filter is never emitted with a staleness above the bound."""
    return max(trainer_version, tail_version)


def _row_span(
    attended: numpy.ndarray, loss: numpy.ndarray | None, versions: numpy.ndarray | None, fallback: int
) -> RowSpan:
    seqlen = int(attended.sum())
    if loss is not None:
        generated: numpy.ndarray | None = loss[attended] == 1
    elif versions is not None:
        generated = versions[attended] >= 0
    else:
        generated = None  # nothing tells prompt from answer
    if generated is None:
        return RowSpan(seqlen, seqlen, fallback, fallback)
    where = numpy.flatnonzero(generated)
    if where.size == 0:
        return RowSpan(seqlen, seqlen, PROMPT_VERSION, PROMPT_VERSION)
    known = versions[attended][generated] if versions is not None else where[:0]
    known = known[known >= 0]
    if known.size == 0:
        return RowSpan(seqlen, int(where[0]), fallback, fallback)
    return RowSpan(seqlen, int(where[0]), int(known.min()), int(known.max()))


def _as_array(values: Any) -> numpy.ndarray:
    """``values`` as a numpy array: an array as it is, a torch tensor's values (detached, on
    the CPU) without importing torch here."""
    if isinstance(values, numpy.ndarray):
        return values
    return values.detach().cpu().numpy()


def _optional_array(values: Any | None) -> numpy.ndarray | None:
    return None if values is None else _as_array(values)

"""Splitting one step's groups between ranks: whole groups, balanced by tokens, deterministic."""

from __future__ import annotations

from collections.abc import Sequence


def split_by_tokens(tokens: Sequence[int], ranks: int) -> list[list[int]]:
    """The indices of ``tokens`` (one entry per group) that each of ``ranks`` ranks gets.

    Greedy longest-first: groups in decreasing token count (ties: lower index first) each go
    to the rank with the fewest tokens so far (ties: fewer groups, then lower rank). The
    result depends only on ``tokens`` and ``ranks``; every rank gets at least one group when
    there are at least ``ranks`` groups with a token each; each rank's indices are in step
    order; the heaviest rank exceeds the lightest by at most the largest group.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    shares: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for index in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], len(shares[r]), r))
        shares[rank].append(index)
        loads[rank] += tokens[index]
    return [sorted(share) for share in shares]

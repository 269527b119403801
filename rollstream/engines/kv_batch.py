"""A left-padded KV cache shared by every running request of the local engine.

Rows join (their prefilled cache padded on the left to the batch length) and leave (dropped,
and padding columns no row needs trimmed) without recomputing the other rows.
"""

from __future__ import annotations

from typing import Any

import torch


def make_cache(layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
    from transformers import DynamicCache

    if not layers:
        return DynamicCache()
    try:
        return DynamicCache(ddp_cache_data=layers)
    except TypeError:  # transformers < 4.56
        return DynamicCache.from_legacy_cache(tuple(layers))


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers < 4.56


def pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class KVBatch:
    """The left-padded KV cache of the running rows. Used by the worker thread only.

    Invariant: for every row the cache holds all of its tokens but the last sampled one,
    which the next decode pass feeds in. ``mask`` is 1 on real positions.
    """

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None

    def keep(self, wanted: set[int]) -> None:
        """Drop rows not in ``wanted`` and trim columns that are padding for every row."""
        idx = [i for i, sid in enumerate(self.rows) if sid in wanted]
        if len(idx) == len(self.rows):
            return
        if not idx:
            self.rows, self.cache, self.mask = [], None, None
            return
        assert self.mask is not None
        sel = torch.tensor(idx, device=self.mask.device)
        mask = self.mask[sel]
        cut = mask.shape[1] - int(mask.sum(-1).max())
        self.cache = make_cache([(k[sel, :, cut:], v[sel, :, cut:]) for k, v in cache_layers(self.cache)])
        self.mask = mask[:, cut:]
        self.rows = [self.rows[i] for i in idx]

    def extend(self, rows: list[int], cache: Any, mask: torch.Tensor) -> None:
        """Append freshly prefilled rows, left-padding whichever side is shorter."""
        if not self.rows:
            self.rows, self.cache, self.mask = list(rows), cache, mask
            return
        assert self.mask is not None
        length = max(self.mask.shape[1], mask.shape[1])
        merged = [
            (torch.cat([pad_left(k0, length, 2), pad_left(k1, length, 2)]),
             torch.cat([pad_left(v0, length, 2), pad_left(v1, length, 2)]))
            for (k0, v0), (k1, v1) in zip(cache_layers(self.cache), cache_layers(cache))
        ]
        self.cache = make_cache(merged)
        self.mask = torch.cat([pad_left(self.mask, length, 1), pad_left(mask, length, 1)])
        self.rows += rows

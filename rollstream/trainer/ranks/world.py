"""The ranks a trainer's steps are shared between, and the collectives that share them.

Under ``torchrun`` (``torch.distributed`` initialized with more than one rank) the trainer's
own collectives run on a separate **gloo** process group, whatever the default backend is: the
shares are CPU bytes, and with NCCL as the default backend (GPU training) the model's
collectives stay on NCCL while the step bookkeeping never touches the GPU. The process group is made
by every rank in the same order, in :meth:`Ranks.detect` (a collective call).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """This process's ``rank`` among ``world_size``; ``process_group`` is None for a single process."""

    rank: int = 0
    world_size: int = 1
    process_group: Any = None  # a torch.distributed ProcessGroup (gloo)
    src: int = 0  # the global rank of the process group's rank 0

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one that reads Kafka, splits steps and commits them."""
        return self.rank == 0

    @classmethod
    def detect(cls, process_group: Any = None, timeout_seconds: float = 3600.0) -> Ranks:
        """The ranks of ``process_group`` (default: every rank of the initialized default
        process group, in a gloo process group of their own)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        if process_group is None:
            if dist.get_world_size() == 1:
                return cls()
            process_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))
        world = dist.get_world_size(process_group)
        if world == 1:
            return cls()
        return cls(dist.get_rank(process_group), world, process_group, dist.get_global_rank(process_group, 0))

    def scatter(self, payloads: list[bytes] | None) -> bytes:
        """Rank 0 passes one payload per rank; every rank returns its own."""
        if self.process_group is None:
            assert payloads is not None
            return payloads[0]
        out: list[Any] = [None]
        dist.scatter_object_list(out, payloads if self.is_leader else None, src=self.src, group=self.process_group)
        return out[0]

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (picklable)."""
        if self.process_group is None:
            return value
        box = [value if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.src, group=self.process_group)
        return box[0]

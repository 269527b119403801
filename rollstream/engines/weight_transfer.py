"""Weights over a torch.distributed process group: the protocol the trainer and the servers share.

This module imports nothing of rollstream and nothing but torch beyond the standard library: it
runs in the trainer (``rollstream.trainer.weight_sender``) and INSIDE a vLLM server's workers
(``rollstream.engines.vllm_worker_extension``), whose environments differ.

The trainer's rank 0 hosts a ``TCPStore`` (the rendezvous). For each version it sends:

1. it writes the version's *manifest* (every tensor's name, dtype, shape and place in a bucket)
   under a session of its own, then opens the session (key ``open``);
2. a server's workers *join*: worker 0 takes a ticket (a counter in the store) and names its
   server and its worker count; every worker of that server then forms a process group of its
   own with the trainer (trainer rank 0, worker ``w`` rank ``1 + w``; gloo on CPU, NCCL on
   GPUs) under the ticket's prefix, so a server that dies breaks only its own transfer;
3. the trainer broadcasts the buckets (flat byte buffers of at most ``bucket_bytes``, each
   tensor aligned) in the manifest's order; each worker loads a bucket's tensors as they
   arrive, then every rank of the process group sums its verdict (1: loaded, 0: failed) in one
   all-reduce, so the trainer learns at once whether every worker loaded the version, and a
   peer that died breaks the process group for the other side at once;
4. the trainer closes the session (``open`` set to ""): a server that asks later is told the
   version is no longer served (:class:`NotServing`) at once, and catches up from a checkpoint.

Every wait is bounded by the caller's timeout; a peer that died surfaces as a
:class:`TransferError` naming it.
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

OPEN_KEY = "open"
ALIGN = 64  # bytes: every tensor starts at a multiple of this in its bucket


class TransferError(RuntimeError):
    """A transfer failed or timed out; the message names the peer."""


class NotServing(TransferError):
    """The trainer does not serve the version asked for (any longer): catch up from a checkpoint."""


@dataclass(frozen=True)
class Entry:
    """One tensor's place in the stream."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    bucket: int
    offset: int  # bytes into its bucket
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """What a version's stream holds: its tensors in order and the size of each bucket."""

    version: int
    entries: tuple[Entry, ...]
    bucket_sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.bucket_sizes)

    def encode(self) -> str:
        return json.dumps({"version": self.version, "bucket_sizes": list(self.bucket_sizes),
                           "entries": [[e.name, e.dtype, list(e.shape), e.bucket, e.offset, e.nbytes]
                                       for e in self.entries]})

    @staticmethod
    def decode(text: str | bytes) -> Manifest:
        raw = json.loads(text)
        entries = tuple(Entry(n, d, tuple(s), b, o, nb) for n, d, s, b, o, nb in raw["entries"])
        return Manifest(int(raw["version"]), entries, tuple(raw["bucket_sizes"]))


def plan(version: int, tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Manifest:
    """The manifest of ``tensors`` in buckets of at most ``bucket_bytes`` (a larger tensor gets
    a bucket of its own)."""
    entries: list[Entry] = []
    sizes: list[int] = []
    used = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        start = -(-used // ALIGN) * ALIGN  # aligned
        if not sizes or (start + nbytes > bucket_bytes and used > 0):
            sizes.append(0)
            start = 0
        entries.append(Entry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), len(sizes) - 1,
                             start, nbytes))
        used = start + nbytes
        sizes[-1] = used
    return Manifest(version, tuple(entries), tuple(sizes))


def pack(manifest: Manifest, bucket: int, tensors: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """Bucket ``bucket`` as one byte buffer on ``device``."""
    buffer = torch.empty(manifest.bucket_sizes[bucket], dtype=torch.uint8, device=device)
    for entry in manifest.entries:
        if entry.bucket == bucket:
            flat = tensors[entry.name].detach().contiguous().view(-1).view(torch.uint8)
            buffer[entry.offset: entry.offset + entry.nbytes].copy_(flat)
    return buffer


def unpack(manifest: Manifest, bucket: int, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of bucket ``bucket`` as views of ``buffer`` (which must not be reused)."""
    for entry in manifest.entries:
        if entry.bucket == bucket:
            raw = buffer[entry.offset: entry.offset + entry.nbytes]
            yield entry.name, raw.view(getattr(torch, entry.dtype)).view(entry.shape)


def connect(address: str, timeout: float, master: bool = False) -> dist.TCPStore:
    """The rendezvous store at ``host:port`` (``master``: host it, on that port; 0 = any free)."""
    host, _, port = address.rpartition(":")
    try:
        return dist.TCPStore(host, int(port), is_master=master, timeout=datetime.timedelta(seconds=timeout),
                             wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise TransferError(f"cannot reach the trainer's weight sender at {address}: {exc}") from exc


def process_group(store: dist.Store, prefix: str, rank: int, size: int, backend: str, timeout: float) -> Any:
    """A process group of its own (not the default one) for one server's transfer."""
    prefixed = dist.PrefixStore(prefix, store)
    span = datetime.timedelta(seconds=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, size, span)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = span
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    raise ValueError(f"unknown weight transfer backend {backend!r} (gloo or nccl)")


def new_session(version: int) -> str:
    return f"v{version}-{uuid.uuid4().hex[:8]}"


def ticket_key(session: str, ticket: int) -> str:
    return f"{session}/ticket/{ticket}"


def verdict(pg: Any, ok: bool, device: str | torch.device) -> int:
    """Sum every rank's verdict (1: its part went well) over the process group; ``1 + workers`` when all did."""
    total = torch.tensor([int(ok)], dtype=torch.int64, device=device)
    pg.allreduce([total]).wait()
    return int(total.item())


@dataclass
class Receiver:
    """One server worker's side of one transfer (see the module docstring).

    ``server`` names the server (its URL) in the trainer's logs; ``worker``/``workers``: this
    worker's index among the server's workers (tensor parallel ranks) and their count.
    """

    address: str
    version: int
    server: str
    worker: int = 0
    workers: int = 1
    backend: str = "gloo"
    timeout: float = 60.0
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.received_bytes = 0
        self._store: dist.TCPStore | None = None
        self._process_group: Any = None
        self._ticket = 0
        self._session = ""

    def join(self) -> Manifest:
        """Join the trainer's session for ``version``; NotServing when it does not serve it."""
        store = self._store = connect(self.address, self.timeout)
        served = store.get(OPEN_KEY).decode() if store.check([OPEN_KEY]) else ""
        if not served:
            raise NotServing(f"the trainer at {self.address} serves no version now (v{self.version} is over)")
        session = json.loads(served)
        if int(session["version"]) != self.version:
            raise NotServing(f"the trainer at {self.address} serves v{session['version']}, not v{self.version}")
        self._session = session["session"]
        server_key = f"{self._session}/server/{self.server}"
        try:
            if self.worker == 0:
                self._ticket = int(store.add(f"{self._session}/tickets", 1))
                store.set(ticket_key(self._session, self._ticket),
                          json.dumps({"server": self.server, "workers": self.workers}))
                store.set(server_key, str(self._ticket))
            else:
                self._ticket = int(store.get(server_key))
            manifest = Manifest.decode(store.get(f"{self._session}/manifest"))
            self._process_group = process_group(store, f"{self._session}/{self._ticket}", 1 + self.worker, 1 + self.workers,
                                self.backend, self.timeout)
        except RuntimeError as exc:
            raise TransferError(f"joining the trainer at {self.address} for v{self.version} failed: {exc}") from exc
        return manifest

    def tensors(self, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the version, bucket by bucket as they arrive."""
        for bucket, size in enumerate(manifest.bucket_sizes):
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            try:
                self._process_group.broadcast(buffer, 0).wait()
            except RuntimeError as exc:
                raise TransferError(
                    f"receiving v{self.version} from the trainer at {self.address} failed after "
                    f"{self.received_bytes} of {manifest.nbytes} bytes (bucket {bucket + 1} of "
                    f"{len(manifest.bucket_sizes)}): {exc}") from exc
            self.received_bytes += size
            yield from unpack(manifest, bucket, buffer)

    def acknowledge(self, ok: bool) -> None:
        """Tell the trainer whether this worker loaded every tensor (``verdict``)."""
        try:
            verdict(self._process_group, ok, self.device)
        except RuntimeError as exc:
            if ok:
                raise TransferError(f"the trainer at {self.address} left before v{self.version} was "
                                    f"acknowledged: {exc}") from exc

    def close(self) -> None:
        self._process_group = None  # its connections close with it
        self._store = None

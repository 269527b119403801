"""Codec benchmark: rollstream's wire format against pickle, JSON and memcpy.

Two messages: one episode (prompt 512 + completion 1,536 tokens, every trajectory field) and one
padded batch (16 x 2,048). For the episode, "rollstream" encodes with ``encode_tensor_dict`` +
``encode`` and decodes with ``decode_episode`` + ``decode_tensor_dict`` (torch, as the rollout
worker writes and a trainer reads). For the batch it does what the grouping tier and a trainer
do: the batch arrays lie in one numpy arena (built outside the timed region, as ``build_emitted_group``
pads into one with ``concat_padded_arrays``), encoding is ``pack_arrays`` (no copy) +
``encode(EmittedGroup(packed=...))``, decoding is ``decode_group`` + ``group_tensors``
(torch tensors usable by the trainer). "rollstream, dict not in an arena" packs the plain
torch dict, so ``pack_tensor_dict`` copies it first: the cost a writer pays that does not use
an arena.
"pickle-5" pickles the plain torch tensor dict; "json" writes lists. MB/s count the raw tensor
bytes of the message (the same for every format), so the columns compare directly; the memcpy
anchor copies that many bytes between two preallocated buffers (``numpy.copyto``).

Targets (batch message): encode and decode each >= 40% of memcpy bandwidth and >= 5x faster
than pickle. ``--profile`` runs pyinstrument (``pip install pyinstrument``) on the batch path.
"""

from __future__ import annotations

import json
import pickle
import sys
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from bench.common import Report, base_parser, time_interleaved, time_per_call
from bench.data import padded_batch, payload_bytes, trajectory
from rollstream.trajectory.padding import concat_padded_arrays
from rollstream.wire import ArrayArena, EmittedGroup, Episode, decode_group, decode_episode, encode, pack_arrays
from rollstream.wire.torch_tensors import (
    as_array,
    decode_tensor_dict,
    encode_tensor_dict,
    group_tensors,
    pack_tensor_dict,
)

Codec = tuple[Callable[[], bytes], Callable[[bytes], dict[str, Tensor]]]


def rollstream_episode(tensors: dict[str, Tensor]) -> Codec:
    def enc() -> bytes:
        return encode(Episode(task_id="bench:0:0", sample_idx=0, group_size=8,
                              trajectory=encode_tensor_dict(tensors), stop_reason="length"))
    return enc, lambda data: decode_tensor_dict(decode_episode(data).trajectory)


def rollstream_batch(tensors: dict[str, Tensor] | ArrayArena) -> Codec:
    """Pack + encode, decode + ``group_tensors``: an arena of arrays packs with ``pack_arrays``
    (zero copy, the grouping tier's path), a plain torch dict with ``pack_tensor_dict`` (a copy)."""
    rows = tensors["input_ids"].shape[0]
    pack = pack_arrays if isinstance(tensors, ArrayArena) else pack_tensor_dict

    def enc() -> bytes:
        return encode(EmittedGroup(task_id="bench:0:0", group_size=rows, sample_idx=list(range(rows)), packed=pack(tensors)))
    return enc, lambda data: group_tensors(decode_group(data))


def in_arena(tensors: dict[str, Tensor]) -> ArrayArena:
    """The same values written into one numpy arena, as the grouping tier's ``build_emitted_group`` leaves them."""
    arena = concat_padded_arrays([{k: as_array(v) for k, v in tensors.items()}])
    assert isinstance(arena, ArrayArena)
    return arena


def message_only(case: str, tensors: dict[str, Tensor]) -> Codec:
    """The msgpack step alone: ``encode`` of a message already holding its wire tensors (the
    batch: its one packed buffer), and ``decode_group``/``decode_episode`` (validated, tensors
    not built). Not the target's path."""
    enc, _ = (rollstream_episode if case == "episode" else rollstream_batch)(tensors)
    message = (decode_episode if case == "episode" else decode_group)(enc())
    decode = decode_episode if case == "episode" else decode_group
    return lambda: encode(message), decode


def pickle5(tensors: dict[str, Tensor]) -> Codec:
    return lambda: pickle.dumps(tensors, protocol=5), pickle.loads


def json_lists(tensors: dict[str, Tensor]) -> Codec:
    dtypes = {k: v.dtype for k, v in tensors.items()}

    def dec(data: bytes) -> dict[str, Tensor]:
        return {k: torch.tensor(v, dtype=dtypes[k]) for k, v in json.loads(data).items()}
    return lambda: json.dumps({k: v.tolist() for k, v in tensors.items()}).encode(), dec


def check_round_trip(tensors: dict[str, Tensor], codec: Codec) -> None:
    out = codec[1](codec[0]())
    assert set(out) == set(tensors) and all(torch.equal(out[k], tensors[k]) for k in tensors), "round trip differs"


def measure(case: str, tensors: dict[str, Tensor], codecs: dict[str, Codec], seconds: float) -> list[dict]:
    """The rollstream rows and the memcpy anchors are timed interleaved (their ratio is the
    target); pickle and JSON, far slower, on their own. ``tensors`` is the plain dict."""
    payload = payload_bytes(tensors)
    src = np.random.default_rng(0).integers(0, 255, payload, dtype=np.uint8)
    dst, src_bytes = np.empty_like(src), bytearray(src.tobytes())
    ours = {method: codec for method, codec in codecs.items() if method.startswith("rollstream")}
    ours["  msgpack step only"] = message_only(case, tensors)
    fns: dict[str, Callable[[], object]] = {"copy": lambda: np.copyto(dst, src), "alloc": lambda: bytes(src_bytes)}
    encoded: dict[str, bytes] = {}
    for method, (enc, dec) in ours.items():
        if method in codecs:
            check_round_trip(tensors, (enc, dec))
        data = encoded[method] = enc()
        fns[f"{method} enc"], fns[f"{method} dec"] = enc, lambda dec=dec, data=data: dec(data)
    timed = time_interleaved(fns, total_seconds=4 * seconds)
    copy_s, alloc_s = timed["copy"], timed["alloc"]
    rows = [row(case, method, payload, len(encoded[method]), timed[f"{method} enc"], timed[f"{method} dec"])
            for method in ours]
    for method, codec in codecs.items():
        if method in ours:
            continue
        check_round_trip(tensors, codec)
        data = codec[0]()
        rows.append(row(case, method, payload, len(data), time_per_call(codec[0], seconds),
                        time_per_call(lambda: codec[1](data), seconds)))
    rows.append(row(case, "memcpy (copyto)", payload, payload, copy_s, copy_s))
    rows.append(row(case, "alloc+copy (bytes)", payload, payload, alloc_s, alloc_s))
    return rows


def row(case: str, method: str, payload: int, message: int, enc_s: float, dec_s: float) -> dict:
    return {"case": case, "method": method, "payload_B": payload, "message_B": message,
            "enc_us": enc_s * 1e6, "dec_us": dec_s * 1e6,
            "enc_MB/s": payload / enc_s / 1e6, "dec_MB/s": payload / dec_s / 1e6}


def ratios(rows: list[dict]) -> list[dict]:
    by = {r["method"]: r for r in rows}
    ours, pick, copy = by["rollstream"], by["pickle-5"], by["memcpy (copyto)"]
    return [{
        "case": ours["case"],
        "enc % memcpy": 100 * copy["enc_us"] / ours["enc_us"],
        "dec % memcpy": 100 * copy["dec_us"] / ours["dec_us"],
        "enc x pickle": pick["enc_us"] / ours["enc_us"],
        "dec x pickle": pick["dec_us"] / ours["dec_us"],
        "enc x json": by["json"]["enc_us"] / ours["enc_us"],
        "dec x json": by["json"]["dec_us"] / ours["dec_us"],
    }]


def profile(tensors: dict[str, Tensor]) -> None:
    try:
        from pyinstrument import Profiler
    except ImportError:
        print("--profile needs pyinstrument: pip install pyinstrument", file=sys.stderr)
        return
    enc, dec = rollstream_batch(in_arena(tensors))
    profiler = Profiler(interval=0.0001)
    with profiler:
        for _ in range(3000):
            dec(enc())
    print(profiler.output_text(unicode=False, color=False, show_all=False))


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("codec", __doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="profile the batch encode/decode with pyinstrument")
    args = parser.parse_args(argv)
    report = Report("codec", args.quick)
    seconds = 0.01 if args.quick else 0.5
    episode = trajectory()
    batch = padded_batch(4, 256) if args.quick else padded_batch(16, 2048)
    all_rows, ratio_rows = [], []
    for case, tensors in (("episode", episode), ("batch", batch)):
        if case == "episode":
            codecs = {"rollstream": rollstream_episode(tensors)}
        else:
            codecs = {"rollstream": rollstream_batch(in_arena(tensors)),
                      "rollstream, dict not in an arena (pack copies)": rollstream_batch(tensors)}
        codecs |= {"pickle-5": pickle5(tensors), "json": json_lists(tensors)}
        rows = measure(case, tensors, codecs, seconds)
        all_rows += rows
        ratio_rows += ratios(rows)
    report.table("Encode/decode per message (MB/s over the raw tensor bytes; best of repeated loops)", all_rows)
    report.table("Ratios (rollstream against the anchors)", ratio_rows)
    b = ratio_rows[-1]
    report.target("batch encode, % of memcpy bandwidth", b["enc % memcpy"], 40.0, unit="%")
    report.target("batch decode, % of memcpy bandwidth", b["dec % memcpy"], 40.0, unit="%")
    report.target("batch encode, x faster than pickle-5", b["enc x pickle"], 5.0, unit="x")
    report.target("batch decode, x faster than pickle-5", b["dec x pickle"], 5.0, unit="x")
    report.note("decode is zero-copy (tensors view the message buffer), so it is not bounded by memcpy")
    report.note("'msgpack step only' = encode() of a message that already holds its wire tensors (a batch: "
                "one packed buffer), and decode_group/decode_episode without building tensors: the rest of "
                "'rollstream' is the torch/numpy bookkeeping (episode: encode_tensor_dict, decode_tensor_dict; "
                "batch: pack_arrays, group_tensors)")
    report.note("batch 'rollstream' packs numpy arrays that lie in one arena, as build_emitted_group leaves them "
                "(pack_arrays); 'dict not in an arena' packs a plain torch dict, so pack_tensor_dict copies it first")
    if args.profile:
        profile(batch)
    return report.finish(args.out)


if __name__ == "__main__":
    sys.exit(main())

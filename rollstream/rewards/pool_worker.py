"""The worker side of the reward pool (``rollstream.rewards.pool``): what runs in each process.

A worker says it is ready (an empty frame), then reads chunks of calls from its end of a socket
pair, runs them one at a time in the order given, and answers each call with one frame as soon
as it returns, so the parent always knows which call is running (the oldest unanswered one).
Frames are ``multiprocessing.connection`` frames (a 4-byte big-endian length, then the bytes).

- a chunk: ``pickle.dumps(list_of_call_blobs)``, each blob ``pickle.dumps((fn, args, kwargs))``
  (pickled one by one, so an argument that cannot be unpickled fails only its own call);
- an answer: ``OK`` + the result as a big-endian double (``float(fn(...))``), or ``ERROR`` +
  ``pickle.dumps((exception, traceback_text))``.

This module imports only the standard library's lightest parts: workers start fast and carry
nothing the reward function does not need.
"""

from __future__ import annotations

import array
import pickle
import signal
import struct
import traceback
from multiprocessing.connection import Connection
from typing import Any

READY = b""  # the first frame: the process is up (a call's clock starts when it can run)
OK = b"\x00"
ERROR = b"\x01"
RESULT = struct.Struct("!d")


def serve(conn: Connection) -> None:
    """Say ``READY``, then run chunks of calls from ``conn`` until the parent closes it (or is
    gone)."""
    # Ctrl-C in a terminal signals the whole process group: the parent decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        conn.send_bytes(READY)
        while True:
            for blob in pickle.loads(conn.recv_bytes()):
                conn.send_bytes(run_call(blob))
    except (EOFError, OSError):
        return


def run_call(blob: bytes) -> bytes:
    """The answer frame for one pickled ``(fn, args, kwargs)``."""
    try:
        fn, args, kwargs = pickle.loads(blob)
        return OK + RESULT.pack(float(fn(*args, **kwargs)))
    except BaseException as exc:  # noqa: BLE001 - every failure of the call is its answer
        return ERROR + _pickled_error(exc, traceback.format_exc())


def _pickled_error(exc: BaseException, text: str) -> bytes:
    if not isinstance(exc, Exception):  # SystemExit, KeyboardInterrupt: must not end the parent
        exc = RuntimeError(f"reward function raised {type(exc).__name__}: {exc}")
    try:
        data = pickle.dumps((exc, text))
        pickle.loads(data)  # some exceptions pickle but cannot be rebuilt (required __init__ args)
        return data
    except Exception:  # noqa: BLE001 - send what can cross instead
        return pickle.dumps((RuntimeError(f"{type(exc).__name__}: {exc}"), text))


def decode_answer(frame: bytes) -> float:
    """The result an answer frame carries; raises the call's exception (its remote traceback as
    ``__cause__``)."""
    if frame[:1] == OK:
        return RESULT.unpack_from(frame, 1)[0]
    try:
        exc, text = pickle.loads(frame[1:])
    except Exception as error:  # noqa: BLE001 - report it as the call's failure
        raise RuntimeError(f"the reward worker's answer cannot be unpickled: {error!r}") from None
    raise exc from RemoteTraceback(text)


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (shown as its cause)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


# array typecodes of the integer widths token ids come in
_TYPECODES = {(4, "i"): "i", (8, "i"): "q", (4, "u"): "I", (8, "u"): "Q", (2, "i"): "h", (2, "u"): "H"}


def ids_list(typecode: str, data: bytes) -> list[int]:
    """What ``PackedIds`` unpickles to in the worker: a plain list of ints."""
    return array.array(typecode, data).tolist()


class PackedIds:
    """A 1-D integer numpy array that crosses to the worker as raw bytes and arrives there as a
    plain ``list[int]`` (what reward functions take): a few µs instead of building, pickling and
    unpickling a list of thousands of ints in the parent."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        code = _TYPECODES.get((self.array.dtype.itemsize, self.array.dtype.kind))
        if code is None or not self.array.dtype.isnative:
            return list, (self.array.tolist(),)
        return ids_list, (code, self.array.tobytes())

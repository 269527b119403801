"""An asyncio-native process pool for reward functions: one round trip per chunk of calls.

Each worker process (:mod:`rollstream.rewards.pool_worker`) runs the calls it is sent one at a
time, in order, and answers each as soon as it returns. The parent side lives in the event
loop (no threads): calls made while the loop runs other work are collected and sent at its next
turn, split into one chunk per worker process. So the reward tier, which scores a poll batch's
records concurrently, pays one frame per worker process per batch instead of one executor task
(two threads, a queue and a pipe each) per call.

What callers may rely on, per call:

- **Timeout**: a call that runs longer than its ``timeout`` fails with :class:`RewardTimeout`. Its
  clock starts when it starts running in its worker, not while it waits behind other calls.
  The worker process is killed (a hung call would hold it forever) and replaced when needed.
- **Isolation**: a worker answers each call before it starts the next, so the pool knows which
  call was running when a worker process died (``os._exit``, a signal, the OOM killer): that
  call fails with ``BrokenProcessPool``; the calls the worker had not started go back to the
  queue untouched and are not counted as tried. A call never fails for what another call did.
- Calls queued behind a call that hangs in the same worker wait for its timeout, then run in
  another worker (at most ``timeout`` later than they would have). A call made with
  ``alone=True`` (the wrapper's retries: calls that already failed once) is sent in a chunk of
  its own and nothing is queued behind it.
- An exception the function raises comes back as itself, the worker's traceback as its
  ``__cause__``; one that cannot cross processes becomes ``RuntimeError`` with its text.

Each event loop that calls has its own ``size`` worker processes (a socket pair each, read with
``loop.add_reader``: any Unix event loop). They start when first needed, with "forkserver" (or
"spawn" where that is missing), never "fork": forking a process that holds torch and its
threads is unsafe.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import socket
import struct
import threading
from collections import deque
from dataclasses import dataclass
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from rollstream.rewards.pool_worker import decode_answer, serve

logger = logging.getLogger(__name__)

START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
_HEADER = struct.Struct("!i")  # multiprocessing.connection's frame header (frames < 2 GiB)
_READ_SIZE = 1 << 18
_EXIT_WAIT_SECONDS = 0.2  # a worker whose socket closed is exiting: wait this long for its exit code


class RewardTimeout(TimeoutError):
    """A reward call ran longer than its timeout: raised by :meth:`RewardPool.run` for one
    attempt, and by ``AsyncRewardWrapper.call`` when the last attempt timed out."""


@dataclass(slots=True, eq=False)
class _Call:
    """One call waiting for, or running in, a worker process."""

    blob: bytes  # pickle.dumps((fn, args, kwargs))
    name: str
    timeout: float
    alone: bool  # runs in a chunk of its own, nothing queued behind it
    future: asyncio.Future[float]
    started: float = 0.0  # loop.time() when it became its worker's running call


class _Worker:
    """One worker process, its end of the socket pair, and the calls sent to it (oldest first:
    the first is running, the others wait in the process)."""

    def __init__(self, workers: _LoopWorkers, process: BaseProcess, sock: socket.socket) -> None:
        self.workers = workers
        self.process = process
        self.pid = process.pid
        self.sock = sock
        self.calls: deque[_Call] = deque()
        self.retired = False
        self._loop = workers.loop
        self._fd = sock.fileno()
        self._inbox = bytearray()
        self._outbox = bytearray()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._loop.add_reader(self._fd, self._readable)

    def send(self, calls: list[_Call]) -> None:
        """Hand ``calls`` to the process (it runs them after the ones it has)."""
        frame = pickle.dumps([call.blob for call in calls], protocol=pickle.HIGHEST_PROTOCOL)
        header = _HEADER.pack(len(frame))  # raises (nothing sent) for a frame of 2 GiB or more
        if not self.calls:
            calls[0].started = self._loop.time()
        self.calls.extend(calls)
        self._arm_timer()
        self._write(header, frame)

    def stop(self) -> None:
        """Stop watching the socket, close it, kill the process (no answer is read after this)."""
        self.retired = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop.remove_reader(self._fd)
        if self._outbox:
            self._loop.remove_writer(self._fd)
        self.sock.close()
        kill(self.process)

    # -- socket I/O, in the event loop --

    def _write(self, header: bytes, frame: bytes) -> None:
        if self._outbox:
            self._outbox += header
            self._outbox += frame
            return
        try:
            sent = self.sock.sendmsg([header, frame])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.workers.retire(self, None)
            return
        if sent < len(header) + len(frame):
            self._outbox += (header + frame)[sent:]
            self._loop.add_writer(self._fd, self._writable)

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self._outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.workers.retire(self, None)
            return
        del self._outbox[:sent]
        if not self._outbox:
            self._loop.remove_writer(self._fd)

    def _readable(self) -> None:
        try:
            data = self.sock.recv(_READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the process closed its end: it exited or died
            self.workers.retire(self, None)
            return
        inbox = self._inbox
        inbox += data
        pos, end = 0, len(inbox)
        while end - pos >= _HEADER.size:
            (size,) = _HEADER.unpack_from(inbox, pos)
            if end - pos - _HEADER.size < size:
                break
            start = pos + _HEADER.size
            pos = start + size
            if size:
                self._answered(bytes(inbox[start:pos]))
            else:
                self._ready()
            if self.retired:
                return
        del inbox[:pos]

    def _ready(self) -> None:
        """The process is up: the first call's clock starts now, not at its (earlier) send."""
        if self.calls:
            self.calls[0].started = self._loop.time()

    def _answered(self, frame: bytes) -> None:
        call = self.calls.popleft()
        if not call.future.done():  # a caller that gave up (cancelled) wants nothing
            try:
                call.future.set_result(decode_answer(frame))
            except Exception as exc:  # noqa: BLE001 - the call's own failure, handed to its caller
                call.future.set_exception(exc)
        if self.calls:
            self.calls[0].started = self._loop.time()
            self._arm_timer()
        else:
            self.workers.flush_soon()

    # -- the running call's timeout --

    def _arm_timer(self) -> None:
        head = self.calls[0]
        at = head.started + head.timeout
        if self._timer is not None:
            if self._timer_at <= at:
                return  # it fires first and looks again
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._check_timeout)

    def _check_timeout(self) -> None:
        self._timer = None
        if self.retired or not self.calls:
            return
        head = self.calls[0]
        if self._loop.time() >= head.started + head.timeout:
            self.workers.retire(self, RewardTimeout(f"{head.name} ran longer than {head.timeout} s"))
        else:
            self._arm_timer()


class _LoopWorkers:
    """The worker processes and the queue of calls of one event loop. Used from that loop's
    thread only (``close`` excepted, see there)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, size: int, label: str) -> None:
        self.loop = loop
        self.size = size
        self.label = label
        self.chunks_sent = 0
        self._workers: list[_Worker] = []
        self._pending: deque[_Call] = deque()
        self._flush_scheduled = False
        self._closed = False
        self._exited: list[BaseProcess] = []  # killed or dead, not yet reaped

    def submit(self, call: _Call) -> None:
        if self._closed:
            raise BrokenProcessPool(f"the {self.label} is shut down")
        self._pending.append(call)
        self.flush_soon()

    def flush_soon(self) -> None:
        """Send what waits at the loop's next turn (after every call made in this one)."""
        if self._pending and not self._flush_scheduled and not self._closed:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._closed:
            return
        # an equal share per worker process: a poll batch's calls leave in one chunk per worker
        chunk = -(-len(self._pending) // self.size)
        for worker in list(self._workers):
            if not self._pending:
                return
            if not worker.calls:
                self._send(worker, self._take(chunk))
        while self._pending and len(self._workers) < self.size:
            try:
                worker = self._start_worker()
            except Exception as exc:  # noqa: BLE001 - the calls fail with it (and are retried)
                logger.error("cannot start a process of the %s: %r", self.label, exc)
                if not self._workers:
                    for call in self._take(len(self._pending)):
                        call.future.set_exception(exc)
                return
            self._send(worker, self._take(chunk))

    def _send(self, worker: _Worker, calls: list[_Call]) -> None:
        if not calls:
            return
        try:
            worker.send(calls)
        except Exception as exc:  # noqa: BLE001 - e.g. arguments of 2 GiB: these calls fail, not the loop
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(exc)
            return
        self.chunks_sent += 1

    def _take(self, n: int) -> list[_Call]:
        """Up to ``n`` calls from the front of the queue; a call that runs alone is taken only
        as a chunk of its own."""
        calls: list[_Call] = []
        while self._pending and len(calls) < n:
            call = self._pending[0]
            if call.future.done():  # its caller gave up
                self._pending.popleft()
                continue
            if call.alone and calls:
                break
            calls.append(self._pending.popleft())
            if call.alone:
                break
        return calls

    def _start_worker(self) -> _Worker:
        context = multiprocessing.get_context(START_METHOD)
        sock, child_sock = socket.socketpair()
        child_end = Connection(child_sock.detach())  # what multiprocessing.Pipe() makes
        process = context.Process(target=serve, args=(child_end,), daemon=True, name="rollstream-reward")
        try:
            process.start()
        except BaseException:
            sock.close()
            raise
        finally:
            child_end.close()
        sock.setblocking(False)
        worker = _Worker(self, process, sock)
        self._workers.append(worker)
        return worker

    def retire(self, worker: _Worker, error: BaseException | None) -> None:
        """Take ``worker`` out of service and kill its process. Its running call fails with
        ``error`` (None: the process died on its own: ``BrokenProcessPool``); the calls it had
        not started go back to the front of the queue."""
        if worker.retired:
            return
        if error is None:
            worker.process.join(_EXIT_WAIT_SECONDS)  # for its exit code
        worker.stop()
        self._workers.remove(worker)
        self._exited.append(worker.process)
        running = worker.calls.popleft() if worker.calls else None
        waiting = len(worker.calls)
        self._pending.extendleft(reversed(worker.calls))
        worker.calls.clear()
        if error is None:
            what = f"while running {running.name}" if running else "while idle"
            error = BrokenProcessPool(
                f"the {self.label}'s process {worker.pid} died {what} (exit code {worker.process.exitcode})"
            )
        if running is not None and not running.future.done():
            running.future.set_exception(error)
        logger.warning("%s: process %d retired: %s; %d calls it had not started go to other processes",
                       self.label, worker.pid, error, waiting)
        self._reap()
        self.flush_soon()

    def _reap(self) -> None:
        for process in list(self._exited):
            if process.exitcode is not None:  # polls without waiting
                process.close()
                self._exited.remove(process)

    def close(self) -> None:
        """Kill every worker process; calls that wait fail with ``BrokenProcessPool``. From
        another thread while the loop runs, the loop's part is done in the loop's thread."""
        self._closed = True
        workers, self._workers = self._workers, []
        for worker in workers:
            kill(worker.process)  # thread-safe: the rest may have to wait for the loop
        if self.loop.is_running() and not _in_loop_thread(self.loop):
            self.loop.call_soon_threadsafe(self._close_in_loop, workers)
        else:
            self._close_in_loop(workers)

    def _close_in_loop(self, workers: list[_Worker]) -> None:
        calls = list(self._pending)
        self._pending.clear()
        for worker in workers:
            calls += worker.calls
            worker.stop()
            self._exited.append(worker.process)
        if not self.loop.is_closed():
            error = BrokenProcessPool(f"the {self.label} was shut down")
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(error)
        for process in self._exited:
            process.join(1.0)
        self._exited.clear()


class RewardPool:
    """Worker processes for reward calls: ``size`` per event loop that uses it (see the module
    docstring for what a call may rely on). ``refcount``: the reward wrappers that use it
    (``rollstream.rewards.wrapper``)."""

    def __init__(self, max_workers: int | None) -> None:
        self.max_workers = max_workers
        self.size = max(1, max_workers or os.cpu_count() or 1)
        self.refcount = 0
        self.label = f"reward process pool (max_workers={max_workers})"
        self._by_loop: dict[asyncio.AbstractEventLoop, _LoopWorkers] = {}
        self._lock = threading.Lock()

    async def run(self, blob: bytes, name: str, timeout: float, alone: bool = False) -> float:
        """The result of the pickled call ``blob`` (``(fn, args, kwargs)``) run in a worker
        process; raises :class:`RewardTimeout`, ``BrokenProcessPool`` or the function's exception.
        ``alone``: no other call waits behind it in its worker process (for a call that may
        hang or kill its process: a retry)."""
        loop = asyncio.get_running_loop()
        workers = self._by_loop.get(loop) or self._add_loop(loop)
        future: asyncio.Future[float] = loop.create_future()
        workers.submit(_Call(blob, name, timeout, alone, future))
        return await future

    @property
    def chunks_sent(self) -> int:
        """Frames of calls sent to worker processes so far (all loops)."""
        return sum(workers.chunks_sent for workers in list(self._by_loop.values()))

    def _add_loop(self, loop: asyncio.AbstractEventLoop) -> _LoopWorkers:
        with self._lock:
            for old in [other for other in self._by_loop if other.is_closed()]:
                self._by_loop.pop(old).close()  # a finished asyncio.run's processes
            return self._by_loop.setdefault(loop, _LoopWorkers(loop, self.size, self.label))

    def shutdown(self) -> None:
        """Kill every worker process of every loop; calls still waiting fail."""
        with self._lock:
            loops = list(self._by_loop.values())
            self._by_loop.clear()
        for workers in loops:
            workers.close()


def kill(process: BaseProcess) -> None:
    """SIGKILL ``process`` if it runs (a hung reward function may ignore gentler signals)."""
    try:
        if process.is_alive():
            process.kill()
    except ValueError:  # already closed
        pass


def _in_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False

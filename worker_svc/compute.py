"""The worker process's compute thread: engine steps run on the process's initial thread.

torch's CPU kernels run 1.5-2.5x slower when called from any thread but the process's first
(measured on the 2-core Xeon, 2 threads, the same calls one after the other: 20 int8
products at 1 row 1.55 -> 3.45 ms, at 32 rows 5.1 -> 12.6 ms, float32 5.5 -> 7.4 ms, SiLU
2.9 -> 6.4 ms; a batch-1 int8 decode step 16.5 -> 30 ms). The products run there as they
run on the main thread under OMP_WAIT_POLICY=passive (libgomp's workers sleeping between
calls), and SiLU's loss went away with MALLOC_ARENA_MAX=1 (other threads allocate from
their own malloc arenas). Worse, once a second thread has run torch work, the main thread's
steps are slow too (two OpenMP pools on two cores). So ``python -m
worker_svc`` gives its initial thread to the steps (``HostThreadExecutor.run``) and serves
gRPC from an event loop on a second thread, handing each step over with ``submit``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_STOP = object()


class HostThreadExecutor(Executor):
    """Runs submitted calls one at a time on the thread that calls ``run``."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = threading.Event()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self._closed.is_set():
            raise RuntimeError("the compute thread has stopped")
        future: Future[Any] = Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def run(self, poll_s: float = 0.5) -> None:
        """Run calls until ``shutdown``; signals still reach this thread between polls."""
        while True:
            try:
                item = self._queue.get(timeout=poll_s)
            except queue.Empty:
                continue
            if item is _STOP:
                break
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller, as a thread pool would
                future.set_exception(exc)
            else:
                future.set_result(result)
        # Calls queued behind the stop are refused rather than left pending forever.
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                item[0].set_exception(RuntimeError("the compute thread has stopped"))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Make ``run`` return once the calls already queued are done."""
        if not self._closed.is_set():
            self._closed.set()
            self._queue.put(_STOP)

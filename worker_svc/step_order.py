"""Numbered steps run in the order their scheduler numbered them.

With overlapped scheduling the scheduler sends step N+1 before step N has answered, so two calls
of one worker can be in flight at once; gRPC does not promise which handler reaches the engine
lock first. Each StepRequest carries the scheduler's number for it (``seq``, rising for as long as
the scheduler runs); a step waits until the one numbered before it has queued for the engine.

A reset (the scheduler's first step to this worker, or its first after taking the worker back)
sets the count, whatever it was. A numbered step at or below the count that is not a reset is
stale (sent before a reset that has run, or overtaken by one while it waited) and is refused: it
must not touch the books the reset started afresh. A scheduler starts its numbers at its start
time in microseconds, so that a restarted one's steps are never taken for an old one's stale
ones, even those that reach the worker before its first reset. Unnumbered steps (0) pass at once.
"""

from __future__ import annotations

import asyncio


class StaleStep(Exception):
    """The step was numbered before a reset (or a step) that has already taken its turn."""


class StepOrder:
    def __init__(self) -> None:
        self._last = 0  # the highest number that has taken its turn (0: none since start-up)
        self._waiting: dict[int, asyncio.Future[None]] = {}  # number -> the step waiting for it

    async def turn(self, seq: int, reset: bool = False, timeout: float | None = None) -> None:
        """Return once every earlier numbered step has taken its turn. The caller must queue for
        the engine before its next await. StaleStep for a step whose turn has passed;
        TimeoutError when the step before never came (the count then moves past it, so that the
        steps after this one are not held up as well)."""
        if not seq:
            return
        if reset:
            self._take(seq, reset=True)
            return
        if seq <= self._last:
            raise StaleStep(f"step {seq} came after step {self._last} (or a reset numbered so) had run")
        if seq > self._last + 1:
            waiter = self._waiting.get(seq)
            if waiter is None:
                waiter = asyncio.get_running_loop().create_future()
                self._waiting[seq] = waiter
            try:
                await asyncio.wait_for(asyncio.shield(waiter), timeout)
            except TimeoutError:
                if self._waiting.get(seq) is waiter:
                    del self._waiting[seq]
                self._last = max(self._last, seq)  # the gap will not be filled: go on after it
                self._wake()
                raise
            # (a reset may have overtaken it while it waited)
            waiter.result()
        self._take(seq)

    def _take(self, seq: int, reset: bool = False) -> None:
        self._last = seq if reset else max(self._last, seq)
        if reset:
            # Steps numbered before the reset, still waiting for their turn, are stale.
            for number in [n for n in self._waiting if n <= seq]:
                waiter = self._waiting.pop(number)
                if not waiter.done():
                    waiter.set_exception(StaleStep(f"step {number} was overtaken by a reset numbered {seq}"))
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiting.pop(self._last + 1, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def last(self) -> int:
        return self._last

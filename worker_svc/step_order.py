"""Numbered steps run in the order their scheduler numbered them.

With overlapped scheduling the scheduler sends step N+1 before step N has answered, so two calls
of one worker can be in flight at once; gRPC does not promise which handler reaches the engine
lock first. Each StepRequest carries the scheduler's number for it (``seq``); a step waits until
the one numbered before it has queued for the engine. Unnumbered steps (0) and resets pass at
once (a reset starts the count afresh), as does the first step a worker sees.
"""

from __future__ import annotations

import asyncio


class StepOrder:
    def __init__(self) -> None:
        self._last: int | None = None  # the highest number that has taken its turn
        self._waiting: dict[int, asyncio.Future[None]] = {}  # number -> the step waiting for it

    async def turn(self, seq: int, reset: bool = False, timeout: float | None = None) -> None:
        """Return once every earlier numbered step has taken its turn. The caller must queue for
        the engine before its next await. TimeoutError when the step before never came."""
        if seq and not reset and self._last is not None and seq > self._last + 1:
            before = seq - 1
            waiter = self._waiting.get(before)
            if waiter is None or waiter.done():
                waiter = asyncio.get_running_loop().create_future()
                self._waiting[before] = waiter
            try:
                await asyncio.wait_for(asyncio.shield(waiter), timeout)
            finally:
                if self._waiting.get(before) is waiter and waiter.done():
                    del self._waiting[before]
        self._took(seq, reset)

    def _took(self, seq: int, reset: bool) -> None:
        if not seq:
            return
        self._last = seq if reset or self._last is None else max(self._last, seq)
        waiter = self._waiting.pop(seq, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def last(self) -> int | None:
        return self._last

"""Progress of the long commands (sweep, experiment, soak, bench): a tqdm bar with an ETA when
the stream is a terminal, plain timestamped lines otherwise (a log file, CI, a pipe).

A plain line: `[  12.3s] sweep 2/4 (50%, eta 12s): concurrency 4: 8 sessions`; a note without
progress: `[   0.4s] sweep: reference outputs from the numpy model (tiny)`.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`advance()` when one unit of work is done, `note()` (or call it) to say what is going on.
    A Progress is also a `Callable[[str], None]`, for code that only reports messages."""

    def __init__(
        self,
        desc: str,
        total: int | None = None,
        stream: TextIO | None = None,
        tty: bool | None = None,
        line_every: int = 1,
        clock=time.monotonic,
    ) -> None:
        self.desc = desc
        self.total = total
        self.done = 0
        self.stream = stream
        self.line_every = max(1, line_every)  # plain lines for message-less advances: every N units
        self._clock = clock
        self._t0 = clock()
        self._bar = None
        if stream is not None and (stream.isatty() if tty is None else tty):
            from tqdm import tqdm

            # disable=False: bench/__main__ sets TQDM_DISABLE to silence gguf's own bars.
            self._bar = tqdm(
                total=total, desc=desc, file=stream, unit="step", dynamic_ncols=True, disable=False, leave=True
            )

    @classmethod
    def silent(cls) -> "Progress":
        return cls("")

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._t0

    def eta_s(self) -> float | None:
        if not self.total or not self.done:
            return None
        return self.elapsed_s / self.done * max(self.total - self.done, 0)

    def _stamp(self) -> str:
        return f"[{self.elapsed_s:6.1f}s]"

    def _count(self) -> str:
        if not self.total:
            return f"{self.done}"
        eta = self.eta_s()
        tail = f", eta {eta:.0f}s" if eta is not None and self.done < self.total else ""
        return f"{self.done}/{self.total} ({100 * self.done / self.total:.0f}%{tail})"

    def set_total(self, total: int) -> None:
        """The units of work, once the caller knows them."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def note(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(f"{self._stamp()} {message}", file=self.stream)
        elif self.stream is not None:
            print(f"{self._stamp()} {self.desc}: {message}", file=self.stream, flush=True)

    __call__ = note

    def advance(self, n: int = 1, message: str = "") -> None:
        self.done += n
        if self._bar is not None:
            if message:
                self._bar.set_postfix_str(message, refresh=False)
            self._bar.update(n)
        elif self.stream is not None:
            finished = self.total is not None and self.done >= self.total
            if message or finished or self.done % self.line_every == 0:
                text = f"{self._stamp()} {self.desc} {self._count()}"
                print(f"{text}: {message}" if message else text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def for_terminal(desc: str, total: int | None = None, line_every: int = 1) -> Progress:
    """Progress on stderr: a bar when stderr is a terminal, plain lines otherwise."""
    return Progress(desc, total, sys.stderr, line_every=line_every)

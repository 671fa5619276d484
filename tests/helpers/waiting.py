"""Waiting for a condition a test cannot be told of, with a deadline that names what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], timeout_s: float = 30.0, interval_s: float = 0.05) -> T:
    """Poll `check` until it returns something true, and return that; AssertionError naming
    `what` once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(interval_s)
    return got

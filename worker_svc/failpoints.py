"""Faults on purpose, for the tests of fault isolation (as etcd's gofail or TiKV's fail-rs do).

``KVFLEET_FAILPOINTS`` lists armed points, comma-separated, each ``name:seed=N``: the point
fails (raises ``FailpointHit``) for work whose sampling seed is N. Unset, nothing is armed and a
check costs one environment lookup. Points:

- ``worker.sample``: sampling an item on the host (temperature > 0, penalties, bias, logprobs
  or a constraint) raises, as a sampling fault would.
- ``worker.forward``: the batched forward of a step holding such an item raises, as a device
  fault would (the whole step fails, not one item).
"""

from __future__ import annotations

import functools
import os

ENV = "KVFLEET_FAILPOINTS"
POINTS = ("worker.sample", "worker.forward")


class FailpointHit(RuntimeError):
    """An armed failpoint fired."""


@functools.lru_cache(maxsize=8)
def _parse(text: str) -> dict[str, frozenset[int]]:
    armed: dict[str, set[int]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, cond = part.partition(":")
        key, _, value = cond.partition("=")
        if name not in POINTS or key != "seed" or not value.isdigit():
            raise ValueError(f"{ENV}: {part!r} is not NAME:seed=N with NAME one of {list(POINTS)}")
        armed.setdefault(name, set()).add(int(value))
    return {k: frozenset(v) for k, v in armed.items()}


def check(name: str, seeds: int | list[int]) -> None:
    """Raise FailpointHit if ``name`` is armed for one of ``seeds``."""
    text = os.environ.get(ENV)
    if not text:
        return
    armed = _parse(text).get(name)
    if armed and not armed.isdisjoint([seeds] if isinstance(seeds, int) else seeds):
        raise FailpointHit(f"failpoint {name} fired ({ENV}={text})")

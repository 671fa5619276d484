"""The KV-view mode (``kv_views``): how attention gets contiguous K/V (see ``kv_cache``).

An Enum parsed once where a string enters the worker (flags, the StepRequest, a library
caller), so the engine and the views never compare magic strings. Torch-free, so the entry
point can validate flags without importing the model.
"""

from __future__ import annotations

from enum import Enum


class KVViewsMode(Enum):
    REBUILD = "rebuild"  # the control: gather every session's blocks every layer
    PERSISTENT = "persistent"  # the candidate: per-session rows kept across steps

    @classmethod
    def parse(cls, value: KVViewsMode | str) -> KVViewsMode:
        """The mode named by ``value``; ValueError naming kv_views when there is none."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            names = " or ".join(repr(m.value) for m in cls)
            raise ValueError(f"kv_views must be {names}, got {value!r}") from None

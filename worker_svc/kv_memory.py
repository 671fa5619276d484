"""How many KV blocks a worker allocates: ``--num-blocks``, or as many as fit in
``--kv-cache-memory`` (a size such as 2GiB or 512MB, or a fraction such as 0.25 of the memory
available when the worker starts)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux); 0 where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def parse_memory(text: str, available: int | None = None) -> int:
    """Bytes for a size ("2GiB", "512MB", "1073741824") or for a fraction in (0, 1) of the
    memory available now ("0.25"). ValueError says what is accepted."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"kv cache memory must be a size (e.g. 2GiB, 512MB, 1073741824) or a fraction of the "
            f"available memory (e.g. 0.25), got {text!r}"
        )
    value = float(m.group(1))
    if not unit and 0 < value < 1:
        free = available_bytes() if available is None else available
        if free <= 0:
            raise ValueError(f"kv cache memory {text!r} is a fraction, but this system reports no available memory")
        return int(value * free)
    if unit == "" and value != int(value):
        raise ValueError(f"kv cache memory {text!r}: a fraction must be in (0, 1); a size needs whole bytes")
    return int(value * _UNITS[unit])


def blocks_for(memory_bytes: int, block_size: int, kv_bytes_per_token: int) -> int:
    """The KV blocks that fit in ``memory_bytes``; ValueError when not even one does."""
    per_block = block_size * kv_bytes_per_token
    blocks = memory_bytes // per_block
    if blocks < 1:
        raise ValueError(
            f"kv cache memory of {memory_bytes} bytes holds no block: one block of {block_size} "
            f"tokens takes {per_block} bytes for this model"
        )
    return blocks

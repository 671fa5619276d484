"""How many KV blocks a worker allocates: as many as fit in ``--kv-cache-memory`` (a size
such as 2GiB or 512MB, or a fraction such as 0.25 of the memory available when the worker
starts), else ``--num-blocks``, else the default pool (``default_pool_bytes``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)

# The default pool must fit a laptop beside the weights: at most 1 GiB, and at most a quarter
# of the memory available at start (a worker is one process of several: scheduler, gateway,
# other workers). SmolLM2-135M's 45 KiB a token (float32 KV; 22.5 with float16) then gets 1456
# blocks of 16 (23k tokens; 2912) where the old fixed 4096 blocks took 3 GB. A small model's KV is
# capped at 4096 blocks (65k tokens, the old default), which no workload here fills: the tiny
# model's 1.5 KiB a token would otherwise ask for 44k blocks, a pool zeroed at start for nothing.
DEFAULT_POOL_BYTES = 2**30
DEFAULT_POOL_FRACTION = 0.25
DEFAULT_MAX_BLOCKS = 4096

# The --kv-dtype choices (the element type: worker_svc/platform.py, kv_cache_dtype).
KV_DTYPES = ("auto", "float32", "float16")


# For flags' help texts.
DEFAULT_POOL_TEXT = (
    f"as many blocks as fit in min({DEFAULT_POOL_BYTES / 2**30:g} GiB, {DEFAULT_POOL_FRACTION:g} of the free "
    f"memory), at most {DEFAULT_MAX_BLOCKS}"
)


@dataclass(frozen=True)
class KVPlan:
    """The pool a worker allocates, and which setting chose it (for the start line)."""

    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    source: str  # "--kv-cache-memory 2GiB", "--num-blocks", "default"

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.kv_bytes_per_token


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


def default_pool_bytes(available: int) -> int:
    """The default pool's memory: DEFAULT_POOL_BYTES, or less where a quarter of ``available``
    is less (``available`` <= 0: the system does not say, so the fixed size)."""
    if available <= 0:
        return DEFAULT_POOL_BYTES
    return min(DEFAULT_POOL_BYTES, int(DEFAULT_POOL_FRACTION * available))


def plan_pool(
    num_blocks: int, kv_cache_memory: str, block_size: int, kv_bytes_per_token: int, available: int | None = None
) -> KVPlan:
    """The pool: ``kv_cache_memory`` when given (it wins), else ``num_blocks`` when > 0, else
    the default (at most DEFAULT_MAX_BLOCKS). ``available``: the memory available now (None:
    read it); ValueError where the memory chosen holds no block."""
    if num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0 (0 = the default pool), got {num_blocks}")
    if kv_cache_memory:
        blocks = blocks_for(parse_memory(kv_cache_memory, available), block_size, kv_bytes_per_token)
        return KVPlan(blocks, block_size, kv_bytes_per_token, f"--kv-cache-memory {kv_cache_memory}")
    if num_blocks:
        return KVPlan(num_blocks, block_size, kv_bytes_per_token, "--num-blocks")
    memory = default_pool_bytes(available_bytes() if available is None else available)
    blocks = min(DEFAULT_MAX_BLOCKS, blocks_for(memory, block_size, kv_bytes_per_token))
    return KVPlan(blocks, block_size, kv_bytes_per_token, "default")

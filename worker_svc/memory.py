"""A worker's memory: what it holds at idle (the weights in their serving format and the KV
pool), the bound its resident memory stays under, and the load's freed heap handed back."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from dataclasses import dataclass

from worker_svc.kv_memory import KVPlan

# Issue 25: at idle a worker's memory is at most its weights + its KV pool + this. It pays for
# the interpreter with torch, numpy and gRPC imported, the grammar engine's vocabulary (~50 MB)
# and the forward's scratch. Held on the memory the worker alone holds (procinfo.private_bytes:
# its RSS less the libraries' file pages, which are shared, droppable, and counted in RSS by
# how much of them the page cache holds: 105 MB of a float32 SmolLM2 worker's 905 MB RSS in one
# checkout, 180 MB of 980 MB in a fresh clone of the same commit on the same machine).
RSS_HEADROOM_BYTES = 400 * 10**6

MB = 10**6


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes: int  # the weights as the forward reads them (Engine.weight_bytes)
    weight_format: str  # float32 | bfloat16 | float16 | int8 | gguf
    kv: KVPlan
    kv_dtype: str = "float32"  # the KV cache's element type (its bytes are in kv)

    @property
    def bound_bytes(self) -> int:
        """The most the worker's RSS should be at idle."""
        return self.weight_bytes + self.kv.pool_bytes + RSS_HEADROOM_BYTES

    def describe(self) -> str:
        kv = self.kv
        return (
            f"weights {self.weight_bytes / MB:.0f} MB in {self.weight_format}, KV pool "
            f"{kv.pool_bytes / MB:.0f} MB of {self.kv_dtype} = {kv.num_blocks} blocks of {kv.block_size} tokens ({kv.source}); "
            f"idle RSS bound {self.bound_bytes / MB:.0f} MB"
        )


def release_freed_memory() -> bool:
    """Collect garbage, then return the heap's free pages to the system (glibc's
    ``malloc_trim``); False where the C library has none. Why: loading frees hundreds of MB in
    arrays of a few MB each (the checkpoint's float tensors, their concatenations), which
    glibc keeps in its free lists once its mmap threshold has risen past their size; measured
    on SmolLM2 float32, 1330 MB resident after the load -> 860 MB after the trim."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is None:  # musl, macOS
        return False
    trim(0)
    return True

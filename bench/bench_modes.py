"""The engine modes one ``python -m bench`` run measures side by side (issue 25 point 5)."""

from __future__ import annotations

from dataclasses import dataclass

from worker_svc.config import WorkerConfig
from worker_svc.kv_views_mode import KVViewsMode

QUICK_HELP = "at most one batch of sessions per concurrency, one tiny sweep, the quality table on a slice"


# --kv-views of the benchmarks: by default what a worker runs (WorkerConfig), so that a figure is
# the served mode's unless a run names the other.
KV_VIEWS = [m.value for m in KVViewsMode]
KV_VIEWS_DEFAULT = WorkerConfig.kv_views.value


@dataclass(frozen=True)
class Mode:
    name: str
    dtype: str = "float32"
    quant: str = "none"


# The CPU's modes: float weights in two dtypes, our int8 blocks, and the GGUF's own blocks.
CPU_MODES = {
    "float32": Mode("float32"),
    "bfloat16": Mode("bfloat16", dtype="bfloat16"),
    "int8": Mode("int8", quant="int8"),
    "gguf": Mode("gguf", quant="gguf"),
}


def pick_modes(modes: str | None, dtype: str | None, quant: str | None, device: str) -> tuple[Mode, ...]:
    """``--modes``, or the one mode ``--dtype`` / ``--quant`` name, or every CPU mode on a CPU
    (float32 alone elsewhere: int8 and gguf run on the CPU only)."""
    if modes and (dtype or quant):
        raise ValueError("--modes, or --dtype / --quant for one mode, not both")
    if dtype or quant:
        q = quant or "none"
        return (Mode(q if q != "none" else dtype or "float32", dtype or "float32", q),)
    names = [m.strip() for m in (modes or "").split(",") if m.strip()]
    if not names:
        return tuple(CPU_MODES.values()) if device == "cpu" else (CPU_MODES["float32"],)
    unknown = [m for m in names if m not in CPU_MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}: choose from {','.join(CPU_MODES)}")
    return tuple(CPU_MODES[m] for m in names)

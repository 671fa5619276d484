"""CPU time of the cluster's processes, per tick: a figure the machine's load barely moves (wall
times on a shared 2-core machine do), and the budget a tick rate has to fit in: n ticks/s need
n x (the processes' CPU per tick) <= the cores."""

from __future__ import annotations

import os
from collections.abc import Mapping


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc; 0.0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def snapshot(pids: Mapping[str, int]) -> dict[str, float]:
    return {name: process_cpu_s(pid) for name, pid in pids.items()}


def per_tick_ms(before: Mapping[str, float], after: Mapping[str, float], ticks: int) -> dict[str, float]:
    """Each process's CPU milliseconds per tick between two snapshots, and their `total`."""
    out = {name: round((after[name] - before[name]) * 1000 / max(ticks, 1), 3) for name in before}
    out["total"] = round(sum(out.values()), 3)
    return out


def tick_ceiling(total_ms_per_tick: float, cores: int | None = None) -> float:
    """The ticks/s the cores could give at that CPU per tick, were every process perfectly
    overlapped: cores x 1000 / total."""
    n = cores or os.cpu_count() or 1
    return round(n * 1000 / total_ms_per_tick, 1) if total_ms_per_tick > 0 else float("inf")

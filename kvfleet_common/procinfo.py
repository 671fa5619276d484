"""The process's own resource use, as the services report it."""

from __future__ import annotations

import os


def resident_bytes() -> int:
    """This process's resident memory (RSS) now; 0 where the system does not say (Linux only:
    /proc/self/statm's second field, in pages)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")

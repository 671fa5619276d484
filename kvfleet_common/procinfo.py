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


def private_bytes() -> int:
    """The memory this process alone holds: RssAnon + RssShmem of /proc/self/status (its heap,
    anonymous mappings and shared memory), i.e. its RSS less the file pages of the libraries and
    files it maps. Those are shared with every process mapping them and can be dropped and read
    again at will; how many count in RSS depends on the page cache (libtorch_cpu.so alone counted
    53 MB in one checkout's worker and 110 MB in a fresh clone's, the same machine and code).
    0 where the system does not say."""
    total = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return 0
    return total

"""What this CPU can run, read once: the SIMD flags that pick a kernel level (``q8``), and
whether this process may use the AMX tiles."""

from __future__ import annotations

import ctypes
import logging
import platform
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

# Linux gives a process the AMX tile state (8 KB more in every signal frame and context
# switch) only when asked: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once, for all
# its threads; a tile instruction before that is SIGILL.
_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags and "avx512bw" in self.flags

    @property
    def avx512_vnni(self) -> bool:
        return self.avx512 and "avx512vl" in self.flags and "avx512_vnni" in self.flags

    @property
    def amx(self) -> bool:
        return "amx_int8" in self.flags

    @property
    def level(self) -> str:
        """The highest of amx / avx512_vnni / avx512 / avx2 / scalar this CPU runs."""
        for name, ok in (("amx", self.amx), ("avx512_vnni", self.avx512_vnni), ("avx512", self.avx512)):
            if ok:
                return name
        return "avx2" if self.avx2 else "scalar"


@cache
def cpu_features() -> CpuFeatures:
    """This machine's flags (Linux /proc/cpuinfo; none elsewhere, i.e. the scalar level)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return CpuFeatures(frozenset())
    for line in text.splitlines():
        if line.startswith("flags"):
            return CpuFeatures(frozenset(line.partition(":")[2].split()))
    return CpuFeatures(frozenset())


@cache
def amx_usable() -> bool:
    """Whether this process may run AMX tile instructions: the CPU has AMX-INT8 and Linux
    granted the tile state (asked here, once per process; a kernel before 5.16, or a hypervisor
    that does not pass the state through, refuses). The answer is logged."""
    if not cpu_features().amx or not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        if libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                        ctypes.c_long(_XFEATURE_XTILEDATA)) != 0:  # fmt: skip
            log.info("AMX: the kernel refused the tile state (errno %d)", ctypes.get_errno())
            return False
        granted = ctypes.c_ulong(0)
        libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_GET_XCOMP_PERM), ctypes.byref(granted))
    except (OSError, AttributeError) as e:
        log.info("AMX: cannot ask for the tile state: %s", e)
        return False
    return bool(granted.value >> _XFEATURE_XTILEDATA & 1)

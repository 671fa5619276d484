"""What this CPU can run, read once: the SIMD flags that pick a kernel level (``q8``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path


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

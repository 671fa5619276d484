"""The C libraries the CPU forward loads with ctypes (``fused_ops.c``, ``q8_kernels.c``,
``gguf_kernels.c``): how each
is compiled, where the package's own build of it lies, and the first-use compile of a checkout
that has none.

The package build compiles every library (``setup.py``'s ``build_ext``: a wheel, ``pip install .``
and the editable ``make install`` alike) into ``_<name><python extension suffix>`` next to this
module, with the flags below, and writes ``_native_build.json`` beside them (what each was built
with, and the build machine's CPU flags: ``fused_ops`` is ``-march=native``, so it is used only on
a CPU with every flag of the one it was built on). A library the build's compiler could not make
(an old compiler without AVX-512 VNNI) is skipped there with a warning. Where no fitting build
is installed (a checkout never built), ``locate`` compiles the library with the system's C
compiler on first use into ``cache_dir()`` (``KVFLEET_CACHE_DIR``; the tests point it at a
temporary folder). Standard library only: ``setup.py`` imports this at build time, without torch.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from worker_svc.model.cpu_features import cpu_features

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
BUILD_INFO = "_native_build.json"  # written by the package build next to the libraries
CACHE_ENV = "KVFLEET_CACHE_DIR"
# With OpenMP the libraries share their rows among torch's intra-op threads: they then need
# libgomp.so.1, which the dynamic loader resolves to the copy torch already loaded (same
# soname), so both use one runtime and one pool. Without torch's libgomp (builds of torch on
# another OpenMP runtime) a library is built single-threaded.
OPENMP_FLAGS = ("-fopenmp",)
Q8_LEVELS = ("scalar", "avx2", "avx512")  # lowest first


@dataclass(frozen=True)
class LibSpec:
    """One library: ``name`` (installed as ``_<name>``), its C source next to this module, the
    compiler's flags (OpenMP apart), and whether they tie it to the build machine's CPU."""

    name: str
    source: str
    flags: tuple[str, ...]
    native: bool = False

    @property
    def source_path(self) -> Path:
        return HERE / self.source


FUSED = LibSpec("fused_ops", "fused_ops.c", ("-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC"), native=True)
# No -march=native: each level's functions carry their own target attribute. KV_Q8_LEVELS=i
# holds the levels up to Q8_LEVELS[i], so a compiler without one level's instructions still
# builds the lower levels' libraries.
Q8 = {
    level: LibSpec(f"q8_{level}", "q8_kernels.c", ("-O3", "-shared", "-fPIC", f"-DKV_Q8_LEVELS={i}"))
    for i, level in enumerate(Q8_LEVELS)
}
# The GGUF block products (``gguf_kernels.c``, ``gguf_quant``): the same levels, built the same
# way, and one more, amx: the avx512 library's levels with the row groups' products on AMX tiles
# (KV_GGUF_AMX), so a compiler that cannot build avx512 (or AMX) leaves it out too.
GGUF_LEVELS = (*Q8_LEVELS, "amx")  # lowest first
GGUF = {
    level: LibSpec(f"gguf_{level}", "gguf_kernels.c", ("-O3", "-shared", "-fPIC", f"-DKV_Q8_LEVELS={i}"))
    for i, level in enumerate(Q8_LEVELS)
}
GGUF["amx"] = LibSpec("gguf_amx", "gguf_kernels.c", (*GGUF["avx512"].flags, "-DKV_GGUF_AMX"))
LIBRARIES = (FUSED, *Q8.values(), *GGUF.values())


class Origin(Enum):
    INSTALLED = "installed"  # built with the package, next to this module
    COMPILED = "compiled"  # compiled on first use into cache_dir()


@dataclass(frozen=True)
class Located:
    path: Path
    origin: Origin


def installed_name(spec: LibSpec) -> str:
    """The file name the package build gives ``spec`` (``_q8_avx2.cpython-311-x86_64-linux-gnu.so``)."""
    return f"_{spec.name}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def cpu_key() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "\n" + "\n".join(lines)


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvfleet"
    )
    return Path(base) / "fused"


def compile_library(spec: LibSpec, out: Path, openmp: bool, compiler: str | None = None) -> None:
    """Compile ``spec`` into ``out`` (through a temporary name, then a rename: workers starting
    together may race). Raises RuntimeError with the compiler's message when it cannot."""
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    flags = [*spec.flags, *(OPENMP_FLAGS if openmp else ())]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        run = subprocess.run(
            [compiler, *flags, "-o", tmp, str(spec.source_path), "-lm"], capture_output=True, text=True, timeout=120
        )
        if run.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {spec.source}: {run.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_cached(spec: LibSpec, openmp: bool, dest_dir: Path | None = None) -> Path:
    """The first-use build: ``spec`` compiled into ``dest_dir`` (default ``cache_dir()``) unless
    already built there for this source, these flags and this CPU; returns the .so."""
    flags = [*spec.flags, *(OPENMP_FLAGS if openmp else ())]
    key = hashlib.sha256(spec.source_path.read_bytes() + cpu_key().encode() + " ".join(flags).encode())
    lib = (dest_dir or cache_dir()) / f"{spec.name}-{key.hexdigest()[:16]}.so"
    if not lib.exists():
        compile_library(spec, lib, openmp)
    return lib


def build_record(built: dict[str, bool]) -> dict[str, object]:
    """What ``_native_build.json`` holds: each built library's flags and OpenMP (``built``:
    name -> whether with OpenMP), and the build machine's CPU flags."""
    by_name = {spec.name: spec for spec in LIBRARIES}
    return {
        "machine": platform.machine(),
        "cpu_flags": sorted(cpu_features().flags),
        "libraries": {
            name: {"flags": list(by_name[name].flags), "openmp": omp, "source_sha256": _digest(by_name[name])}
            for name, omp in built.items()
        },
    }


def _digest(spec: LibSpec) -> str:
    return hashlib.sha256(spec.source_path.read_bytes()).hexdigest()


def installed(spec: LibSpec, openmp: bool, where: Path = HERE) -> Path | None:
    """The package's build of ``spec`` in ``where``, if there is one that fits this process:
    built with these flags, with OpenMP only where ``openmp`` (torch's libgomp), and for a ``native`` library on a CPU whose flags this
    one has too; from the C source beside it (a checkout's source edited since its build is
    compiled anew). None otherwise (logged when a build is there but does not fit)."""
    path = where / installed_name(spec)
    if not path.exists():
        return None
    try:
        record = json.loads((where / BUILD_INFO).read_text())
        entry = record["libraries"][spec.name]
    except (OSError, ValueError, KeyError) as e:
        log.info("%s: no build record for it (%s), not used", path.name, e)
        return None
    why = ""
    if entry.get("flags") != list(spec.flags):
        why = f"built with {entry.get('flags')}, wanted {list(spec.flags)}"
    elif entry.get("openmp") and not openmp:  # (a build without OpenMP runs anywhere, on one thread)
        why = "built with OpenMP, and this torch does not bring libgomp.so.1"
    elif spec.source_path.exists() and entry.get("source_sha256") != _digest(spec):
        why = f"{spec.source} changed since it was built"
    elif spec.native:
        missing = set(record.get("cpu_flags", ())) - cpu_features().flags
        if record.get("machine") != platform.machine() or missing:
            why = f"built for another CPU (this one lacks {sorted(missing)[:8]})"
    if why:
        log.info("%s not used: %s", path.name, why)
        return None
    return path


def locate(spec: LibSpec, openmp: bool) -> Located:
    """The installed build of ``spec`` if it fits, else the first-use build in ``cache_dir()``.
    Raises RuntimeError where neither is possible (no compiler, or it fails)."""
    path = installed(spec, openmp)
    if path is not None:
        return Located(path, Origin.INSTALLED)
    return Located(build_cached(spec, openmp), Origin.COMPILED)

"""Weight-only int8 products in blocks of 32 (``q8_kernels.c``), at the CPU's best level.

``--quant int8`` stores each product's weight [N, K] as int8 with one float32 scale per row and
block of 32 columns (``Q8Weight``, rows in groups of 16); the activations stay float32, each
int8 column widened to float and multiplied in (see the C file for the layout and levels). The kernel's level is
picked once, at load (``Q8Kernels.load``): the best of avx512 (AVX-512 VNNI), avx2 and scalar
that this CPU runs, or the one ``KVFLEET_Q8_LEVEL`` names (a lower one, for tests and
comparisons; a level the CPU cannot run is refused).

Built like ``fused`` (with the package, else with the system's C compiler on first use: see
``native``) but without ``-march=native``: each function carries its own target. One library
per level (``_q8_<level>``, each holding the levels up to its own), so a build whose compiler
lacks a level's instructions still has the lower ones; a level without a library is
unavailable, and the default level is the best one this CPU runs that has one.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Callable, TypeVar

import torch

from worker_svc.model import fused, native
from worker_svc.model.cpu_features import CpuFeatures, cpu_features

log = logging.getLogger(__name__)

SOURCE = native.Q8["scalar"].source_path
QK = 32
GROUP_ROWS = 16  # rows per group in the kernels' layout
LEVELS = native.Q8_LEVELS  # lowest first
ALL_LEVELS = native.GGUF_LEVELS  # every family's levels, lowest first (the gguf blocks' add amx)
LEVEL_ENV = "KVFLEET_Q8_LEVEL"
K = TypeVar("K")  # a kernel family loaded at one level
_P = ctypes.c_void_p
_L = ctypes.c_long


def load_level(
    kind: str,
    level: str | None,
    at: Callable[[str], K],
    runnable: Callable[[], tuple[str, ...]] | None = None,
    levels: tuple[str, ...] = LEVELS,
) -> K:
    """``at(level)`` for a family of kernels (int8 blocks, GGUF blocks) at ``level``, default
    ``KVFLEET_Q8_LEVEL``, else the best this CPU runs that has a library. ``levels`` are the
    family's (lowest first) and ``runnable()`` those of them this CPU runs (default: this
    module's). ``KVFLEET_Q8_LEVEL`` naming a level the family lacks (amx, for the int8 blocks)
    caps it: the family's best runnable level below that one. ValueError for a level this CPU
    cannot run; RuntimeError where no level's library is installed or can be built."""
    ok = (runnable or runnable_levels)()
    env = os.environ.get(LEVEL_ENV) if level is None else None
    if env and env not in levels and env in ALL_LEVELS:
        below = [lv for lv in ok if ALL_LEVELS.index(lv) < ALL_LEVELS.index(env)]
        level = below[-1] if below else env
    else:
        level = level or env
    if level is not None:
        if level not in ok:
            raise ValueError(f"{kind} kernel level {level!r} is not one this CPU runs ({', '.join(ok)})")
        return at(level)
    errors = []
    for best in reversed(ok):
        try:
            return at(best)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("%s kernel level %s unavailable: %s", kind, best, e)
            errors.append(f"{best}: {e}")
    raise RuntimeError(f"no {kind} kernel level has a library: " + "; ".join(errors))


def runnable_levels(features: CpuFeatures | None = None) -> tuple[str, ...]:
    """The kernel levels this CPU runs, lowest first."""
    f = features or cpu_features()
    ok = {"scalar": True, "avx2": f.avx2 and "fma" in f.flags, "avx512": f.avx512_vnni}
    return tuple(level for level in LEVELS if ok[level])


@dataclass(frozen=True)
class Q8Weight:
    """A weight [N, K] as int8 in [-127, 127] with one float32 scale per row and block of 32
    columns (block max |w| / 127), in the kernels' layout (see ``q8_kernels.c``): rows in
    groups of 16 (N padded with zero rows), each group block by block, column by column:
    ``qs`` int8 [G, Kp / 32, 32, 16], ``scales`` float32 [G, Kp / 32, 16] (Kp = K rounded up
    to 32, the padding zero); and the kernels its products run on."""

    qs: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    kernels: Q8Kernels | None = field(default=None, compare=False)

    def linear(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 times this weight -> [M, N] (added into ``out`` when given)."""
        if self.kernels is None:
            y = reference_linear(x, self)
            return y if out is None else out.add_(y)
        return self.kernels.linear(x, self, out)

    def row_blocks(self, index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 [R, Kp], float32 [R, Kp / 32]) of the rows ``index`` (default: all N), in
        row-major order (copies)."""
        idx = torch.arange(self.out_features) if index is None else index
        group, lane = idx // GROUP_ROWS, idx % GROUP_ROWS
        qs = self.qs.permute(0, 3, 1, 2)[group, lane]  # [R, nb, 32]
        return qs.reshape(idx.shape[0], -1), self.scales.permute(0, 2, 1)[group, lane]

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 [T, K] of the rows ``index`` [T] alone (a tied int8 head read as the embedding)."""
        qs, scales = self.row_blocks(index)
        full = qs.view(index.shape[0], -1, QK).float() * scales[:, :, None]
        return full.view(index.shape[0], -1)[:, : self.in_features]

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + 4 * self.scales.numel()


def quantize_blocks(w: torch.Tensor, kernels: Q8Kernels | None = None) -> Q8Weight:
    """w: float [N, K] -> its int8 blocks (rounded half to even), in groups of 16 rows."""
    n, k = w.shape
    kp, np_ = -(-k // QK) * QK, -(-n // GROUP_ROWS) * GROUP_ROWS
    padded = torch.zeros(np_, kp, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(np_, kp // QK, QK)
    scales = blocks.abs().amax(dim=2) / 127.0  # [Np, nb]
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    qs = torch.round(blocks * inv[:, :, None]).clamp_(-127, 127).to(torch.int8)
    g, nb = np_ // GROUP_ROWS, kp // QK
    grouped = qs.view(g, GROUP_ROWS, nb, QK).permute(0, 2, 3, 1).contiguous()  # [G, nb, 32, 16]
    group_scales = scales.view(g, GROUP_ROWS, nb).permute(0, 2, 1).contiguous()  # [G, nb, 16]
    return Q8Weight(grouped, group_scales, n, k, kernels)


def dequantize(w: Q8Weight) -> torch.Tensor:
    """The float32 [N, K] the blocks stand for (tests, and the reference product)."""
    return w.rows(torch.arange(w.out_features))


def reference_linear(x: torch.Tensor, w: Q8Weight) -> torch.Tensor:
    """What every level computes, in float64: x times the dequantized weight. x [M, K] ->
    [M, N] float32. Also the product where the C kernels cannot be built (slow: it
    dequantizes on every call)."""
    return (x.double() @ dequantize(w).double().t()).float()


def with_kernels(w: Q8Weight, kernels: Q8Kernels | None) -> Q8Weight:
    return replace(w, kernels=kernels)


class Q8Kernels:
    """The C products at one level."""

    def __init__(
        self, lib: ctypes.CDLL, level: str, path: Path, origin: native.Origin = native.Origin.COMPILED
    ) -> None:
        if level not in LEVELS:
            raise ValueError(f"q8 level must be one of {list(LEVELS)}, got {level!r}")
        self.level, self.path, self.origin = level, path, origin
        self._linear = getattr(lib, f"kv_q8_linear_{level}")
        self._linear.argtypes = [_P, _L, _L, _L, _P, _P, _L, _P, _L, ctypes.c_int]
        self._linear.restype = None

    @staticmethod
    def load(level: str | None = None) -> Q8Kernels:
        """The kernels at ``level`` (default: ``KVFLEET_Q8_LEVEL``, else the best this CPU
        runs that has a library). Raises ValueError for a level the CPU cannot run,
        RuntimeError where that level's library (or, by default, every level's) is neither
        installed nor can be built."""

        def at(level: str) -> Q8Kernels:
            found, lib = _library(level)
            log.info("int8 kernels %s from %s (%s)", level, found.path, found.origin.value)
            return Q8Kernels(lib, level, found.path, found.origin)

        return load_level("int8", level, at)

    def linear(self, x: torch.Tensor, w: Q8Weight, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous) times w -> [M, N] float32; with ``out`` [M, N]
        (rows contiguous) the product is added to it in place and ``out`` returned."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.in_features or x.stride(1) != 1:
            raise ValueError(f"x must be float32 [M, {w.in_features}] with contiguous rows, got {tuple(x.shape)}")
        m = x.shape[0]
        y = out if out is not None else torch.empty(m, w.out_features, dtype=torch.float32)
        if y.dtype != torch.float32 or y.stride(1) != 1 or tuple(y.shape) != (m, w.out_features):
            raise ValueError("out must be float32 [M, N] with contiguous rows")
        self._linear(
            x.data_ptr(), m, w.in_features, x.stride(0), w.qs.data_ptr(), w.scales.data_ptr(),
            w.out_features, y.data_ptr(), y.stride(0), int(out is not None),
        )  # fmt: skip
        return y


def load_kernels(level: str | None = None) -> Q8Kernels | None:
    """``Q8Kernels.load``, or None (logged) where the library cannot be built: the products
    then run torch's reference (correct, several times slower). A level this CPU cannot run
    is still an error."""
    try:
        return Q8Kernels.load(level)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("int8 kernels unavailable, products dequantize on every call: %s", e)
        return None


def available_levels() -> tuple[str, ...]:
    """The levels this CPU runs that have a library (installed, or built on first use)."""
    ok = []
    for level in runnable_levels():
        try:
            _library(level)
            ok.append(level)
        except (OSError, RuntimeError, subprocess.SubprocessError):
            pass
    return tuple(ok)


@cache
def _library(level: str) -> tuple[native.Located, ctypes.CDLL]:
    """The library of ``level``: the package's build, else compiled on first use (cached per
    process; a failure is not, so it is retried by the next load)."""
    found = native.locate(native.Q8[level], fused.torch_uses_libgomp())
    return found, ctypes.CDLL(str(found.path))

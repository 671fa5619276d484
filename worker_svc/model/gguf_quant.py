"""``--quant gguf``: products on a GGUF file's own quantized blocks (``gguf_kernels.c``).

The weights stay as the file has them (``kvfleet_models.gguf_blocks.BlockTensor``: Q8_0, Q4_0,
Q4_1, Q4_K, Q6_K), with no float copy beside them; every call quantizes its float32 input per row
and block of 32 to int8 with the block's integer sum (llama.cpp's Q8_1 scheme for activations:
Q4_1's and Q4_K's min terms need the sum; Q4_K's sub-blocks of 32 are the activations' blocks,
Q6_K's groups of 16 halves of them, so every product is exact in integers per scale) and multiplies in integers at the kernel level picked once at load:
the q8 kernels' levels (scalar / avx2 / avx512 VNNI) and amx (avx512 with the row groups'
products for 16 or more activation rows on AMX tiles, where the CPU has AMX-INT8 and Linux
grants this process the tile state), ``KVFLEET_Q8_LEVEL`` forcing a lower one.

A projection of the model may be several tensors stacked along its output (q, k and v; gate
and up): a ``GGUFWeight`` is those parts, adjacent parts of one format merged into one, each
with an optional per-row output scale (q's attention scale, kept beside the blocks rather than
rounded into their fp16 scales). The tied embedding's lookup dequantizes only the rows it
reads (``GGUFWeight.rows``).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
import torch

from kvfleet_models.gguf_blocks import QK, BlockTensor
from worker_svc.model import fused, native, q8
from worker_svc.model.cpu_features import amx_usable
from worker_svc.model.gguf_packed import GROUPED_FORMATS, RowGroups, group_rows
from worker_svc.model.q8 import load_level

log = logging.getLogger(__name__)

_P = ctypes.c_void_p
_L = ctypes.c_long
LEVELS = native.GGUF_LEVELS  # lowest first


def runnable_levels() -> tuple[str, ...]:
    """The levels this CPU runs, lowest first: the int8 kernels' (``q8.runnable_levels``), and
    amx above avx512 where this process may use the tiles (``cpu_features.amx_usable``)."""
    ok = q8.runnable_levels()
    return (*ok, "amx") if "avx512" in ok and amx_usable() else ok


@dataclass(frozen=True, eq=False)
class GGUFWeight:
    """A weight [N, K]: ``parts`` stacked along N, each with its float32 [rows] output scale
    or None; the products run on ``kernels`` (None: the float64 reference, slow)."""

    parts: tuple[BlockTensor | RowGroups, ...]
    scales: tuple[np.ndarray | None, ...]
    kernels: GGUFKernels | None = field(default=None, compare=False)
    # The C call's arguments for the parts, made once (GGUFKernels.plan).
    plan: tuple[ctypes.Array, ...] = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kernels is not None:
            object.__setattr__(self, "plan", self.kernels.plan(self))

    @property
    def in_features(self) -> int:
        return self.parts[0].cols

    @property
    def out_features(self) -> int:
        return sum(p.shape[0] for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts) + sum(s.nbytes for s in self.scales if s is not None)

    def linear(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 times this weight -> [M, N] (added into ``out`` when given)."""
        if self.kernels is None:
            y = reference_linear(x, self).float()
            return y if out is None else out.add_(y)
        return self.kernels.linear(x, self, out)

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """float32 [T, K]: rows ``tokens`` [T] dequantized (the tied embedding's lookup)."""
        if len(self.parts) != 1 or self.scales[0] is not None:
            raise ValueError("only a weight of one unscaled part is an embedding table")
        return torch.from_numpy(self.parts[0].dequantize(tokens.numpy()))


def stack(parts: list[tuple[BlockTensor, float]], kernels: GGUFKernels | None) -> GGUFWeight:
    """One weight of ``parts`` (each with its output scale) stacked along the output rows;
    adjacent parts of one format share one run of rows (the bytes are copied once, here).
    Where ``kernels`` multiply row groups (the SIMD levels), a run of Q8_0 / Q4_0 / Q4_1 is
    kept in that layout (``gguf_packed``), in place of the file's."""
    if len({p.cols for p, _ in parts}) != 1:
        raise ValueError("stacked parts must have the same number of columns")
    merged: list[list[tuple[BlockTensor, float]]] = []
    for part in parts:
        if merged and merged[-1][0][0].format == part[0].format:
            merged[-1].append(part)
        else:
            merged.append([part])
    tensors: list[BlockTensor | RowGroups] = []
    scales: list[np.ndarray | None] = []
    for run in merged:
        fmt, cols = run[0][0].format, run[0][0].cols
        data = run[0][0].data if len(run) == 1 else np.concatenate([p.data for p, _ in run])
        tensor = BlockTensor(fmt, data, cols)
        grouped = kernels is not None and kernels.groups_rows and fmt.name in GROUPED_FORMATS
        tensors.append(group_rows(tensor) if grouped else tensor)
        if all(s == 1.0 for _, s in run):
            scales.append(None)
        else:
            scales.append(np.concatenate([np.full(p.shape[0], s, dtype=np.float32) for p, s in run]))
    return GGUFWeight(tuple(tensors), tuple(scales), kernels)


def quantize_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the C quantizer makes of x [M, K] (K a multiple of 32), in torch: (int8 [M, K],
    float32 scales [M, K / 32], int32 block sums [M, K / 32]); round half to even, as rintf."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // QK, QK)
    s = blocks.abs().amax(dim=2) / 127.0
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    a = torch.round(blocks * inv[:, :, None]).to(torch.int8)
    return a.reshape(m, k), s, a.to(torch.int32).sum(dim=2)


def reference_linear(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """What every level computes, in float64: the weight dequantized exactly, times x quantized
    as the C quantizer does, times the rows' scales. x [M, K] -> float64 [M, N]."""
    a, s, _ = quantize_input(x)
    m, k = a.shape
    xq = (a.double().view(m, k // QK, QK) * s.double()[:, :, None]).view(m, k)
    outs = []
    for part, scale in zip(w.parts, w.scales):
        y = xq @ torch.from_numpy(part.dequantize(dtype=np.float64)).t()
        outs.append(y if scale is None else y * torch.from_numpy(scale).double())
    return torch.cat(outs, dim=1)


class GGUFKernels:
    """The C block products at one level."""

    def __init__(
        self, lib: ctypes.CDLL, level: str, path: Path, origin: native.Origin = native.Origin.COMPILED
    ) -> None:
        if level not in LEVELS:
            raise ValueError(f"gguf kernel level must be one of {list(LEVELS)}, got {level!r}")
        if level == "amx" and not amx_usable():  # a tile instruction would be SIGILL
            raise ValueError("this process may not use the AMX tiles (cpu_features.amx_usable)")
        self.level, self.path, self.origin = level, path, origin
        # The SIMD levels multiply row groups (gguf_packed): the weights are stored that way.
        self.groups_rows = level != "scalar"
        self._linear = getattr(lib, f"kv_gguf_linear_{level}")
        self._linear.argtypes = [ctypes.c_int, _P, _P, _P, _P, _P, _L, _P, _L, _L, _P, _L, ctypes.c_int]
        self._linear.restype = ctypes.c_int
        # the levels with AVX-512 quantize their input with it (the same values)
        self._quantize = lib.kv_gguf_quantize_avx512 if level in ("avx512", "amx") else lib.kv_gguf_quantize
        self._quantize.argtypes = [_P, _L, _L, _L, _P, _P, _P]
        self._quantize.restype = None

    @staticmethod
    def load(level: str | None = None) -> GGUFKernels:
        """The kernels at ``level`` (default: ``KVFLEET_Q8_LEVEL``, else the best this CPU runs
        that has a library). ValueError for a level this CPU cannot run; RuntimeError where no
        library is installed or can be built."""

        def at(level: str) -> GGUFKernels:
            found, lib = _library(level)
            log.info("gguf kernels %s from %s (%s)", level, found.path, found.origin.value)
            return GGUFKernels(lib, level, found.path, found.origin)

        return load_level("gguf", level, at, runnable_levels, LEVELS)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The C input quantizer on its own: x [M, K] float32 -> (int8 [M, K], float32
        [M, K / 32], int32 [M, K / 32])."""
        m, k = x.shape
        a = torch.empty(m, k, dtype=torch.int8)
        s = torch.empty(m, k // QK, dtype=torch.float32)
        sums = torch.empty(m, k // QK, dtype=torch.int32)
        self._quantize(x.data_ptr(), m, k, x.stride(0), a.data_ptr(), s.data_ptr(), sums.data_ptr())
        return a, s, sums

    def plan(self, w: GGUFWeight) -> tuple[ctypes.Array, ...]:
        """The per-part arrays ``kv_gguf_linear_*`` reads (format codes, data, rows, grouped or
        not, scales); they point into ``w``'s own arrays, which live as long as it."""
        parts = w.parts
        data = [p.packed if isinstance(p, RowGroups) else p.data for p in parts]
        return (
            (ctypes.c_int * len(parts))(*(p.format.code for p in parts)),
            (ctypes.c_void_p * len(parts))(*(d.ctypes.data for d in data)),
            (ctypes.c_long * len(parts))(*(p.shape[0] for p in parts)),
            (ctypes.c_int * len(parts))(*(isinstance(p, RowGroups) for p in parts)),
            (ctypes.c_void_p * len(parts))(*(None if sc is None else sc.ctypes.data for sc in w.scales)),
        )

    def linear(self, x: torch.Tensor, w: GGUFWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous) times w -> [M, N] float32; with ``out`` [M, N]
        (rows contiguous) the product is added to it in place and ``out`` returned. One C
        call: x quantized once, then every part."""
        k, n = w.in_features, w.out_features
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
            raise ValueError(f"x must be float32 [M, {k}] with contiguous rows, got {tuple(x.shape)}")
        m = x.shape[0]
        y = out if out is not None else torch.empty(m, n, dtype=torch.float32)
        if y.dtype != torch.float32 or y.stride(1) != 1 or tuple(y.shape) != (m, n):
            raise ValueError("out must be float32 [M, N] with contiguous rows")
        if w.kernels is not self:
            raise ValueError("the weight was stacked for other kernels")
        codes, data, rows, grouped, scales = w.plan
        if self._linear(
            len(codes), codes, data, rows, grouped, scales, k, x.data_ptr(), x.stride(0), m, y.data_ptr(),
            y.stride(0), int(out is not None),
        ):  # fmt: skip
            raise MemoryError(f"no memory for a [{m}, {k}] product's quantized input")
        return y


def load_kernels(level: str | None = None) -> GGUFKernels | None:
    """``GGUFKernels.load``, or None (logged) where no library can be built: the products then
    run the float64 reference (correct, far slower). A level this CPU cannot run is an error."""
    try:
        return GGUFKernels.load(level)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("gguf kernels unavailable, products dequantize on every call: %s", e)
        return None


@cache
def _library(level: str) -> tuple[native.Located, ctypes.CDLL]:
    """The library of ``level``: the package's build, else compiled on first use (cached per
    process; a failure is not, so the next load retries)."""
    found = native.locate(native.GGUF[level], fused.torch_uses_libgomp())
    return found, ctypes.CDLL(str(found.path))

"""The host BLAS path of a float32 CPU forward: which library runs each product, and threads.

On a CPU in float32 the matmuls go to numpy's BLAS (OpenBLAS) with the matrix stored
[in, out]: measured on a 2-core AMD EPYC, that streams the weights of a batch-1 decode about
1.8x faster than torch's MKL does with either layout, and is on par or faster from 16 rows
(see bench/README.md); on one thread products of 2-12 rows go to torch's MKL, which reads the
same [in, out] copy transposed (the engine keeps no second, [out, in] copy: on the Intel Xeon
that ran them faster, not slower; ``LlamaModel``'s ``torch_copy`` still builds it). Elsewhere (bfloat16, GPUs) only torch's
matmul with [out, in], which its bfloat16 CPU kernels run 1.4-1.5x faster than [in, out].

bfloat16 on a CPU: oneDNN's linear with the weight reordered once into its blocked layout
(``pack_bf16``), 1.3-1.5x faster than torch's matmul on the same [out, in] bfloat16 weights
(measured, the 30 layers' products on 2 threads: 1 row 19.0 -> 13.4 ms, 32 rows 21.9 ->
16.6 ms, 256 rows 48.7 -> 33.2 ms), with float32 activations cast around it. Where oneDNN has
no bfloat16 kernels (an AVX2-only CPU), torch's bfloat16 matmul costs about a gemv per row
(a 576x1536 product on the 2-core AVX2 EPYC: 0.8 ms at 8 rows, 51 ms at 512, 8x float32's);
from ``WIDEN_ROWS`` rows the weight is widened to float32 for the product instead (0.53 ms,
10.3 ms), the same inputs and outputs rounded to bfloat16 (``_bf16_product``).

With ``quant="int8"`` (CPU, float32 activations) every product's weight is int8 in blocks of
32 instead (``q8``), one scale per row and block, widened to float in the kernel at the CPU's
best level; the activations are not rounded. A layer's four products then read ~3.6x fewer bytes.

With ``quant="gguf"`` (a GGUF model, CPU, float32 activations) every product runs on the file's
own quantized blocks (``gguf_quant``: Q8_0, Q4_0, Q4_1), inputs quantized per block of 32 to
int8 in the products; SmolLM2's Q4_1 projections then read about 7x fewer bytes than float32.

numpy's OpenBLAS and torch each keep their own thread pool; ``use_cpu_threads`` gives a step's
threads to one of them only (see there for why).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from worker_svc.model.gguf_quant import GGUFWeight
from worker_svc.model.q8 import Q8Weight

# Row counts of a product that torch's MKL runs faster than numpy's OpenBLAS on one CPU thread
# (15-27 % at 4-12 rows, measured on the 2-core AMD EPYC; OpenBLAS wins at 1 row by 1.7x and is
# on par or ahead from 16 rows): for those the host keeps a second, [out, in] copy of every
# matrix. Only with one thread: torch (hence MKL) runs single-threaded beside the host BLAS.
TORCH_ROWS = range(2, 13)
NO_ROWS = range(0)


QUANT_MODES = ("none", "int8", "gguf")


@dataclass(frozen=True)
class Matrix:
    """One weight matrix in the layouts its products use: ``kn`` [in, out] for numpy's BLAS
    (host BLAS only), ``nk`` [out, in] for torch (unless quantized), ``q8`` int8 blocks
    (``quant="int8"`` only), ``gguf`` the GGUF's own blocks (``quant="gguf"`` only); a
    quantized matrix keeps neither float copy."""

    kn: torch.Tensor | None
    nk: torch.Tensor | None
    q8: Q8Weight | None = None
    gguf: GGUFWeight | None = None
    shape: tuple[int, int] = (0, 0)  # (out, in)
    dnn: torch.Tensor | None = None  # bfloat16 in oneDNN's blocked layout (``pack_bf16``)
    # kn as numpy sees it, made once: a step's small products paid ~0.6 us a call for the view
    kn_array: np.ndarray | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kn = self.kn
        host = kn is not None and kn.device.type == "cpu" and kn.dtype == torch.float32
        object.__setattr__(self, "kn_array", kn.numpy() if kn is not None and host else None)

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the copy that counts as the parameter (sizes are reported once); int8
        weights count one byte per element (and padding) plus a float32 scale per block."""
        if self.q8 is not None:
            return self.q8.nbytes
        if self.gguf is not None:
            return self.gguf.nbytes
        if self.dnn is not None:
            return 2 * self.numel
        t = self.kn if self.kn is not None else self.nk
        assert t is not None
        return t.numel() * t.element_size()


def pack_bf16(w: torch.Tensor) -> torch.Tensor | None:
    """w: bfloat16 [out, in] on the CPU -> oneDNN's blocked copy, or None where oneDNN has no
    bfloat16 kernels. Packed for 32 rows: measured as fast as a 1-row packing at 1-4 rows, and
    faster from 32 rows up."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w, 32)


def _dnn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, in] (any float dtype) -> [M, out] bfloat16."""
    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "")


# Rows from which a bfloat16 product without oneDNN's kernels widens its weight to float32 (the
# widening, O(in x out), costs less than torch's bfloat16 kernel from 4 rows: measured above).
WIDEN_ROWS = 4


def _bf16_product(x: torch.Tensor, nk: torch.Tensor) -> torch.Tensor:
    """x [M, in] float32 times nk [out, in] of reduced precision -> [M, out] in nk's dtype: the
    input rounded to that dtype, as torch's matmul in it does. bfloat16 on a CPU from
    WIDEN_ROWS rows: the products summed in float32 and the sum rounded to bfloat16, as torch's
    (and oneDNN's) bfloat16 matmul does; float16 weights as before, in torch's own kernel."""
    xr = x.to(nk.dtype)
    if nk.dtype == torch.bfloat16 and x.shape[0] >= WIDEN_ROWS and x.device.type == "cpu":
        return (xr.float() @ nk.float().t()).to(torch.bfloat16)
    return xr @ nk.t()


def torch_rows(host_blas: bool, threads: int) -> range:
    """Row counts sent to torch instead of the host BLAS: with more than one thread every
    product goes to the BLAS, as MKL would run on torch's single thread."""
    return TORCH_ROWS if host_blas and threads == 1 else NO_ROWS


def matmul(x: torch.Tensor, w: Matrix, rows_to_torch: range) -> torch.Tensor:
    """x [M, in] times w -> [M, out]."""
    if w.q8 is not None:
        return w.q8.linear(x.contiguous())
    if w.gguf is not None:
        return w.gguf.linear(x.contiguous())
    if w.dnn is not None:
        return _dnn_linear(x, w.dnn).to(x.dtype)
    if w.kn_array is not None and x.shape[0] not in rows_to_torch:
        return torch.from_numpy(np.matmul(x.numpy(), w.kn_array))
    assert w.nk is not None
    if x.dtype != w.nk.dtype:  # bfloat16 weights, float32 activations (CPU)
        return _bf16_product(x, w.nk).to(x.dtype)
    return x @ w.nk.t()


def matmul_add_(h: torch.Tensor, x: torch.Tensor, w: Matrix, rows_to_torch: range) -> None:
    """h += x times w, in place. h: [M, out]; x: [M, in]."""
    if w.q8 is not None:
        w.q8.linear(x.contiguous(), out=h)
    elif w.gguf is not None:
        w.gguf.linear(x.contiguous(), out=h)
    elif w.dnn is not None:
        h.add_(_dnn_linear(x, w.dnn))
    elif w.kn_array is not None and x.shape[0] not in rows_to_torch:
        hn = h.numpy()
        np.add(hn, np.matmul(x.numpy(), w.kn_array), out=hn)
    else:
        assert w.nk is not None
        if x.dtype != w.nk.dtype:
            h.add_(_bf16_product(x, w.nk))
        else:
            h.addmm_(x, w.nk.t())


# Queries a tile of a causal prefill's attention (``attention_core``): each tile's products stop
# at the last key any of its queries sees.
QUERY_TILE = 128


def attention_core(
    q3: torch.Tensor,
    kv: torch.Tensor,
    mask: np.ndarray | None,
    order: str,
    batch: int,
    query_len: int,
    num_kv_heads: int,
    group_size: int,
) -> torch.Tensor:
    """softmax(q k^T + mask) v with numpy's batched matmul: for these many small matrices
    (G*Q x D by D x S, per item and kv head) it ran 3x faster than torch's bmm (measured at
    32 items x 200 keys), and it takes the slab's strided views as they are.

    With a mask and more than one tile of queries, the queries go a tile at a time (QUERY_TILE
    each), every tile's products over the keys up to the last that one of its queries sees:
    a causal chunk's keys past its tile, masked for all of them, are neither multiplied nor
    softmaxed (half of a fresh prompt's attention). The keys a query sees are the same either
    way; only the masked ones, which weigh exactly 0, are left out.

    q3: [N, G*Q, D]; kv: [2, N, S, D]; mask: [B, Q, S] additive, or None. Returns [N, G*Q, D].
    """
    k, v = kv[0].numpy(), kv[1].numpy()  # [N, S, D]
    if mask is None or query_len <= QUERY_TILE:
        return torch.from_numpy(_attend(q3.numpy(), k, v, mask, order, batch, num_kv_heads, group_size))
    n, _, d = q3.shape
    q4 = q3.numpy().reshape(n, group_size, query_len, d)  # G*Q is G-major: [N, G, Q, D]
    out = np.empty_like(q4)
    for t0, t1, s in query_tiles(mask):
        tile = np.ascontiguousarray(q4[:, :, t0:t1]).reshape(n, group_size * (t1 - t0), d)
        got = _attend(tile, k[:, :s], v[:, :s], mask[:, t0:t1, :s], order, batch, num_kv_heads, group_size)
        out[:, :, t0:t1] = got.reshape(n, group_size, t1 - t0, d)
    return torch.from_numpy(out.reshape(n, group_size * query_len, d))


def query_tiles(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """The query tiles of a group's attention, mask [B, Q, S] additive: (first query, end, keys
    the tile's products need: up to the last one of its queries sees), QUERY_TILE queries each."""
    seen = mask == 0
    tiles = []
    for t0 in range(0, mask.shape[1], QUERY_TILE):
        t1 = min(t0 + QUERY_TILE, mask.shape[1])
        keys = np.flatnonzero(seen[:, t0:t1].any(axis=(0, 1)))
        tiles.append((t0, t1, int(keys[-1]) + 1 if keys.size else 1))  # (no key seen: any one will do)
    return tiles


def _attend(
    q3: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, order: str, b: int, hkv: int, g: int
) -> np.ndarray:
    """attention_core on numpy arrays: q3 [N, G*Q, D], k and v [N, S, D], mask [B, Q, S]."""
    scores = np.matmul(q3, k.transpose(0, 2, 1))  # [N, G*Q, S]
    if mask is not None:
        q = mask.shape[1]
        if order == "bh":
            view = scores.reshape(b, hkv, g, q, -1)
            view += mask[:, None, None]
        else:
            view = scores.reshape(hkv, b, g, q, -1)
            view += mask[None, :, None]
    probs = torch.softmax(torch.from_numpy(scores), dim=-1).numpy()
    return np.matmul(probs, v)  # [N, G*Q, D]


def set_host_blas_threads(n: int) -> bool:
    """Set the thread count of numpy's bundled OpenBLAS (its pool is separate from torch's);
    returns whether a library was found. numpy has no API for it, hence ctypes."""
    found = False
    libs = Path(np.__file__).parent.parent / "numpy.libs"
    for path in sorted(libs.glob("*openblas*")) if libs.is_dir() else []:
        lib = ctypes.CDLL(str(path))
        for name in (
            "scipy_openblas_set_num_threads64_",
            "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_",
            "openblas_set_num_threads",
        ):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                found = True
                break
    return found


# A model whose MLP weights have fewer elements than this runs on one thread unless told
# otherwise: its products are too small to split. Measured on the 2-core Intel Xeon (AVX-512),
# decode steps at batch 1-64: the tiny model (32 x 64) and hidden 64 (64 x 256) ran within 3 %
# on 1 and 2 threads while the second thread (numpy's OpenBLAS pool) spun through every step,
# a core taken from the other processes for nothing; hidden 128 (128 x 512) ran 13-14 % faster
# on 2 threads from batch 16, hidden 256 27-33 %, SmolLM2 (576 x 1536) 1.5x at batch 1.
SMALL_MODEL_ELEMENTS = 32768


def default_cpu_threads(hidden_size: int, intermediate_size: int, available: int) -> int:
    """The threads of an engine not told how many: ``available`` (the process's setting), or
    one for a model below ``SMALL_MODEL_ELEMENTS``."""
    return 1 if hidden_size * intermediate_size < SMALL_MODEL_ELEMENTS else available


class ThreadAware(Protocol):
    """A model that routes products by thread count (``LlamaModel``)."""

    def use_threads(self, n: int) -> None: ...


def use_cpu_threads(n: int, host_blas: bool, model: ThreadAware | None = None) -> None:
    """Give a CPU step ``n`` threads, in one thread pool only.

    With the host BLAS (float32 on a CPU) the matmuls run in numpy's OpenBLAS pool and the
    rest in torch's: both pools spin-wait between calls, so with more than one thread each
    they take the cores from each other (measured on 2 cores: a batch-1 decode step went from
    ~50 ms to over 2 s). So the BLAS pool gets the ``n`` threads and torch one (and the model
    stops sending small products to torch's MKL when ``n`` > 1). A process-wide setting: an
    engine owns its worker process's compute.

    Without the host BLAS (int8 or bfloat16 products in torch) torch gets the ``n`` threads
    and the BLAS one, so that numpy's attention products run on the calling thread and its
    pool never spins against torch's.
    """
    want = 1 if host_blas else n
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)
    set_host_blas_threads(n if host_blas else 1)
    if model is not None:
        model.use_threads(n)

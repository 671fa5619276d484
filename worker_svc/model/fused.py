"""The hand-fused CPU ops of ``fused_ops.c``: built with the package, loaded with ctypes.

A batch-1 decode step on the CPU spent more time in small ops than in its weight products
(measured, smollm2 int8 on the 2-core Xeon: 12 ms of products, 12 ms of the rest): every op
after a product finds the caches flushed by the weights it streamed, so torch's ~40 small ops
of a layer (two RMS norms of ~8 ops each and the residual adds, RoPE, attention's views,
softmax and products) run at 3-5x their warm cost. ``FusedOps`` does each of those in one C
call; so does the write of a step's new K/V into the paged cache (``KVStore``). (SiLU-gate
was fused too and measured no faster in a step: it stays torch's.)

For a model of small layers (the tiny one) even those calls are most of a step: ``decode_step``
runs a whole step, every layer and the head, as one call (``kv_decode_step``: the same norms,
RoPE, K/V write and attention, with the products as plain C loops), for ``LlamaModel.whole_step``.

The library (``-O3 -march=native``) is compiled when the package is built (``native``: a wheel,
``pip install``, ``make install``) and used on a CPU with every flag of the build's; where no
such build is installed (a checkout never built), it is compiled with the system's C compiler
on first use into a cache folder keyed by the source and the CPU (well under a second). Without
either, or with ``KVFLEET_FUSED_OPS=0``, ``load`` returns None and the model keeps torch's
ops. Float32 only: every CPU mode keeps its activations in float32 (see ``llama``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker_svc.kv_cache import BlockTable
from worker_svc.model import native

log = logging.getLogger(__name__)

SOURCE = native.FUSED.source_path
_F = ctypes.c_void_p
_L = ctypes.c_long


def torch_uses_libgomp() -> bool:
    """Whether torch's CPU library is linked against libgomp.so.1 (the Linux wheels bundle it):
    the C libraries are then built with OpenMP (see ``native.OPENMP_FLAGS``)."""
    lib_dir = Path(torch.__file__).parent / "lib"
    return sys.platform.startswith("linux") and (lib_dir / "libgomp.so.1").exists()


def build(dest_dir: Path | None = None) -> Path:
    """The first-use build of ``fused_ops.c`` into ``dest_dir`` (default: the cache folder), once
    per source, flags and CPU; returns the .so. Raises RuntimeError with the compiler's message
    when it cannot."""
    return native.build_cached(native.FUSED, torch_uses_libgomp(), dest_dir)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class FusedOps:
    """The C functions, each taking float32 CPU tensors (checked by the caller's layout); the
    decode attention's K/V may also be float16 (the KV cache of the reduced-precision modes)."""

    kv_dtypes = (torch.float32, torch.float16)

    def __init__(self, lib: ctypes.CDLL, path: Path, origin: native.Origin = native.Origin.COMPILED) -> None:
        self.path, self.origin = path, origin  # origin: the package's build, or a first-use compile
        self._rms = lib.kv_rms_norm
        self._rms.argtypes = [_F, _F, _F, _L, _L, ctypes.c_float]
        self._add_rms = lib.kv_add_rms_norm
        self._add_rms.argtypes = [_F, _F, _F, _F, _L, _L, ctypes.c_float]
        self._rope = lib.kv_rope
        self._rope.argtypes = [_F, _L, _F, _L, _L, _L]
        self._max_threads = lib.kv_max_threads
        self._max_threads.argtypes, self._max_threads.restype = [], _L
        # The decode attention's two entries: K/V float32, and K/V float16 (widened as read),
        # each taking its arguments as one struct (``DecodeAttention``).
        self._attn = {torch.float32: lib.kv_decode_attention, torch.float16: lib.kv_decode_attention_f16}
        for fn in self._attn.values():
            fn.argtypes = [ctypes.POINTER(_AttentionArgs)]
        self._store = lib.kv_store
        self._store.argtypes = [ctypes.POINTER(_StoreArgs)]
        self._step = lib.kv_decode_step
        self._step.argtypes = [ctypes.POINTER(_StepArgs)]
        for fn in (self._rms, self._add_rms, self._rope, self._store, self._step, *self._attn.values()):
            fn.restype = None

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, n] contiguous -> a new [T, n]."""
        out = torch.empty_like(x)
        self._rms(_ptr(x), _ptr(w), _ptr(out), x.shape[0], x.shape[1], eps)
        return out

    def add_rms_norm_(self, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """h += y in place (both [T, n] contiguous); returns rms_norm(h) * w, a new [T, n]."""
        out = torch.empty_like(h)
        self._add_rms(_ptr(h), _ptr(y), _ptr(w), _ptr(out), h.shape[0], h.shape[1], eps)
        return out

    def rope_(self, qkv: torch.Tensor, rot: torch.Tensor, heads: int, half: int) -> None:
        """Rotate the first ``heads`` heads of each row of qkv [T, width] (rows contiguous) in
        place; rot: [T, half] complex64, contiguous."""
        self._rope(_ptr(qkv), qkv.stride(0), _ptr(rot), qkv.shape[0], heads, half)

    def kv_store_plan(self, cache: torch.Tensor, slots: torch.Tensor, qkv: torch.Tensor, col: int) -> KVStore:
        """A step's writes of its new K and V into the paged cache, checked once and run on each
        layer (``KVStore``). cache: every layer's K/V [L, 2, Hkv, capacity, D], contiguous,
        float32 or float16 (``kv_dtypes``); slots: int64 [T], each token's slot; qkv: a layer's
        projections [T, width] float32 with unit column stride (every layer's laid out alike),
        its K heads then its V heads from column ``col``."""
        _, two, hkv, capacity, d = cache.shape
        rows = qkv.shape[0]
        if cache.dtype not in self.kv_dtypes or not cache.is_contiguous() or two != 2:
            raise ValueError(
                f"the cache must be [L, 2, Hkv, slots, D] contiguous, float32 or float16, got {cache.dtype}"
            )
        if qkv.dtype != torch.float32 or qkv.stride(1) != 1 or qkv.shape[1] < col + 2 * hkv * d or col < 0:
            raise ValueError("qkv must be float32 [T, width] with unit column stride and K/V from column col")
        if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape != (rows,):
            raise ValueError("slots must be contiguous int64, one per row of qkv")
        if rows and not (0 <= int(slots.min()) and int(slots.max()) < capacity):
            raise ValueError(f"a slot is outside the cache's {capacity}")
        args = _StoreArgs(
            slots=slots.data_ptr(),
            stride=qkv.stride(0),
            col=col,
            rows=rows,
            hkv=hkv,
            dim=d,
            capacity=capacity,
            half=int(cache.dtype == torch.float16),
        )
        return KVStore(self._store, args, cache, slots, qkv)

    def decode_step(self, stack: DecodeStack, cache: torch.Tensor, rows: StepRows) -> StepResult:
        """A whole step, every layer and the head, in one C call (``kv_decode_step``): each of
        the step's tokens a row of its own (``StepRows``), its K/V written into ``cache`` (every
        layer's [L, 2, Hkv, capacity, D], contiguous, float32 or float16; the block size
        ``rows.block_size``). Every index is checked here against what it indexes. Returns the
        logits [T, V] of every row. (The checks are made cheap: at a batch of one they were
        most of the call.) One step at a time per stack: its arguments and scratch are the
        stack's (the engine's steps are one at a time)."""
        s, t, meta, width = stack, rows.rows, rows.meta, rows.page_width
        a = s.args
        if (cache.data_ptr(), cache.shape, cache.dtype, rows.block_size) != s.cache_key:
            self._bind_cache(s, cache, rows.block_size)
        bounds = s.bounds.get((t, width))
        if bounds is None:
            if len(s.bounds) > 256:  # a step's shapes repeat: keep the working set
                s.bounds.clear()
            # Tokens, positions, slots, then blocks, each below what it indexes.
            limits = np.array([s.vocab, s.positions, a.capacity, a.capacity // a.block_size], dtype=np.uint64)
            bounds = s.bounds[(t, width)] = np.repeat(limits, [t, t, t, t * width])
        if t < 1 or meta.dtype != np.int64 or meta.shape != bounds.shape or not meta.flags.c_contiguous:
            raise ValueError("the step's rows must be 3 + page_width int64 values a row, contiguous")
        # A negative index read as unsigned is past every bound: one comparison checks both ends.
        if (meta.view(np.uint64) >= bounds).any():
            raise ValueError("a token, position, slot or block is outside what it indexes")
        keys = int(meta[t : 2 * t].max()) + 1
        if keys > width * a.block_size:
            raise ValueError("a row's position is past its blocks")
        need = t * s.row_floats + s.groups * keys * self._max_threads()
        if s.scratch.numel() < need:
            s.scratch = torch.empty(need, dtype=torch.float32)
        logits = torch.empty((t, s.vocab), dtype=torch.float32)
        base = meta.ctypes.data
        a.tokens, a.positions, a.slots, a.pages = base, base + 8 * t, base + 16 * t, base + 24 * t
        a.rows, a.page_width, a.keys = t, width, keys
        a.scratch, a.logits = s.scratch.data_ptr(), logits.data_ptr()
        self._step(ctypes.byref(a))
        return StepResult(logits, a.kv_write_ns, a.attention_ns)

    def _bind_cache(self, s: DecodeStack, cache: torch.Tensor, block_size: int) -> None:
        """Check the paged cache a stack's steps write, once (it lives as long as its engine)."""
        if cache.dim() != 5 or cache.shape[:3] != (s.n_layers, 2, s.kv_heads) or cache.shape[4] != s.head_dim:
            raise ValueError(
                f"the cache must be [{s.n_layers}, 2, {s.kv_heads}, slots, {s.head_dim}], got {tuple(cache.shape)}"
            )
        if cache.dtype not in self.kv_dtypes or not cache.is_contiguous() or cache.device.type != "cpu":
            raise ValueError(f"the cache must be contiguous float32 or float16 on the CPU, got {cache.dtype}")
        if block_size < 1 or cache.shape[3] % block_size:
            raise ValueError(f"the cache's {cache.shape[3]} slots are not whole blocks of {block_size}")
        a = s.args
        a.cache, a.capacity, a.block_size = cache.data_ptr(), cache.shape[3], block_size
        a.kv_half = int(cache.dtype == torch.float16)
        s.cache_key, s.cache, s.bounds = (cache.data_ptr(), cache.shape, cache.dtype, block_size), cache, {}

    def decode_attention(self, q3: torch.Tensor, kv: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One call: ``decode_attention_plan`` with these arguments, made and run once."""
        return self.decode_attention_plan(q3, kv, *args, **kwargs)(q3, kv)

    def decode_attention_plan(
        self,
        q3: torch.Tensor,
        kv: torch.Tensor,
        lens: torch.Tensor | None,
        bh: bool,
        items: int,
        hkv: int,
        rows: torch.Tensor | None = None,
        pages: BlockTable | None = None,
        firsts: torch.Tensor | None = None,
    ) -> DecodeAttention:
        """The attention of one query per item, checked and laid out for the C call, to run
        on every layer of a step (each with its own q3 and kv of these layouts: ``matches``).
        q3 [N, G, D] float32, contiguous; kv [2, N, S, D] float32 or
        float16 (``kv_dtypes``), with D contiguous;
        lens [B] int64 (keys each item sees, in attention order) or None for all S; firsts [B]
        int64 (the first key each sees: a sliding window's start, each below its lens) or None
        for 0.
        With ``rows`` (int64 [B], bh order only) kv is instead a slab [2, R, Hkv, S, D] and
        item b's keys are its row rows[b], read where they lie (no gather).
        With ``pages`` kv is instead a layer of the paged cache [2, Hkv, slots, D] and item b's
        S keys lie in its blocks, pages.ids[b], read where they lie (no gather).
        q3 may instead be [B, Hq * D] with unit column stride, rows any distance apart (bh
        order only: item b's queries, head after head, as a step's q columns lie in its qkv
        projection), read in place; the result is then [B, Hq * D].
        The plan returns [N, G, D]."""
        d = kv.shape[-1]
        if q3.dim() == 2:
            if not bh or q3.stride(1) != 1 or q3.shape[0] != items or q3.shape[1] % (hkv * d):
                raise ValueError("queries as rows need bh order, [B, Hq * D] with unit column stride")
            n, g, q_stride = items * hkv, q3.shape[1] // (hkv * d), q3.stride(0)
        else:
            if not q3.is_contiguous():
                raise ValueError("queries [N, G, D] must be contiguous")
            n, g, d = q3.shape
            q_stride = 0
        attn = self._attn.get(kv.dtype)
        if attn is None or q3.dtype != torch.float32:
            raise ValueError(f"float32 queries and float32 or float16 K/V, got {q3.dtype} and {kv.dtype}")
        table, width, page = None, 0, 0
        k, v = kv[0], kv[1]
        if pages is not None:
            s, width, page = pages.keys, pages.ids.shape[1], pages.block_size
            if rows is not None or k.stride(2) != 1 or k.stride() != v.stride() or kv.shape[1] != hkv:
                raise ValueError(
                    "pages need a layer of the paged cache, [2, Hkv, slots, D] with D contiguous, and no rows"
                )
            ids = pages.ids
            if ids.dtype != torch.int64 or not ids.is_contiguous() or ids.shape[0] != items or s > width * page:
                raise ValueError("pages must be contiguous int64, a row of blocks per item covering its keys")
            if pages.max_id >= kv.shape[2] // page:
                raise ValueError("a block is past the cache")
            strides = (0, k.stride(1), 0, k.stride(0))
            table = ids
        elif rows is None:
            s = kv.shape[2]
            if k.stride(2) != 1 or k.stride() != v.stride():
                raise ValueError("K/V rows must be contiguous along D, with the same strides")
            strides = (k.stride(0), k.stride(1), 0, 0)
        else:
            s = kv.shape[3]
            if not bh or k.stride(3) != 1 or k.stride() != v.stride() or kv.shape[2] != hkv:
                raise ValueError("slab rows need bh order, [2, R, Hkv, S, D] with D contiguous")
            if rows.dtype != torch.int64 or not rows.is_contiguous() or rows.shape[0] != items:
                raise ValueError("rows must be contiguous int64, one per item")
            if items and int(rows.max()) >= kv.shape[1]:
                raise ValueError("a row is past the slab")
            strides = (0, k.stride(2), k.stride(0), k.stride(1))
        if firsts is not None and (
            firsts.dtype != torch.int64 or not firsts.is_contiguous() or firsts.shape[0] * hkv != n or lens is None
        ):
            raise ValueError("firsts must be contiguous int64, one per item, with lens")
        if lens is not None and (lens.dtype != torch.int64 or not lens.is_contiguous() or lens.shape[0] * hkv != n):
            raise ValueError("lens must be contiguous int64, one per item (each at most S: the caller's check)")
        scratch = torch.empty(g * s * self._max_threads(), dtype=torch.float32)
        args = _AttentionArgs(
            scratch=scratch.data_ptr(),
            lens=_ptr_or_null(lens),
            item_rows=_ptr_or_null(rows),
            pages=_ptr_or_null(table),
            firsts=_ptr_or_null(firsts),
            n_stride=strides[0],
            s_stride=strides[1],
            rows=n,
            groups=g,
            keys=s,
            dim=d,
            hkv=hkv,
            items=items,
            bh=int(bh),
            item_stride=strides[2],
            head_stride=strides[3],
            page_width=width,
            page=page,
            q_stride=q_stride,
        )
        given = (lens, bh, items, hkv, rows, pages, firsts)
        return DecodeAttention(attn, args, q3, kv, given, scratch)


def _ptr_or_null(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _AttentionArgs(ctypes.Structure):
    """fused_ops.c's kv_attention_args, field for field."""

    _fields_ = [
        *((name, _F) for name in ("q", "k", "v", "out", "scratch", "lens", "item_rows", "pages", "firsts")),
        *(
            (name, _L)
            for name in (
                "n_stride",
                "s_stride",
                "rows",
                "groups",
                "keys",
                "dim",
                "hkv",
                "items",
                "bh",
                "item_stride",
                "head_stride",
                "page_width",
                "page",
                "q_stride",
            )
        ),
    ]


class _StoreArgs(ctypes.Structure):
    """fused_ops.c's kv_store_args, field for field."""

    _fields_ = [
        ("qkv", _F),
        ("cache", _F),
        ("slots", _F),
        *((name, _L) for name in ("stride", "col", "rows", "hkv", "dim", "capacity", "half")),
    ]


class _LayerWeights(ctypes.Structure):
    """fused_ops.c's kv_layer_weights, field for field."""

    _fields_ = [(name, _F) for name in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")]


class _StepArgs(ctypes.Structure):
    """fused_ops.c's kv_step_args, field for field."""

    _fields_ = [
        *((name, _F) for name in ("layers", "final_norm", "head", "embed", "rotary")),
        *(
            (name, _L)
            for name in (
                "embed_row", "embed_col", "hidden", "qkv_out", "q_width", "inter", "vocab", "n_layers", "heads",
                "kv_heads", "head_dim",
            )
        ),
        ("eps", ctypes.c_float),
        ("cache", _F),
        *((name, _L) for name in ("capacity", "block_size", "kv_half")),
        *((name, _F) for name in ("tokens", "positions", "slots", "pages")),
        *((name, _L) for name in ("rows", "page_width", "keys")),
        *((name, _F) for name in ("scratch", "logits")),
        ("kv_write_ns", ctypes.c_longlong),
        ("attention_ns", ctypes.c_longlong),
    ]  # fmt: skip


@dataclass(frozen=True)
class StepRows:
    """A whole step's rows, one a token, as ``FusedOps.decode_step`` reads them: ``meta`` holds
    int64 [T] tokens, [T] positions (a row sees its item's keys up to its own), [T] cache
    slots and [T, page_width] the row's item's blocks (padded with block 0), one after the
    other."""

    meta: np.ndarray
    rows: int
    page_width: int
    block_size: int


@dataclass(frozen=True)
class StepResult:
    """``FusedOps.decode_step``'s logits [T, V], and the nanoseconds it spent in the K/V writes
    and in attention (the per-op path's ``PhaseTimes`` phases)."""

    logits: torch.Tensor
    kv_write_ns: int
    attention_ns: int


class DecodeStack:
    """A plain Llama stack's float32 weights, as ``kv_decode_step`` reads them: per layer the
    norms and the [in, out] products (the host BLAS path's copies), the final norm, the head
    [hidden, vocab], the embedding (its row t at ``embed[t * embed_row]``, columns
    ``embed_col`` apart: a tied head's [hidden, vocab] copy serves as the table) and the RoPE
    table [positions, D/2] complex64. Made once per model: the call's arguments (``args``) and
    scratch persist, and the tensors are held here so that the pointers stay valid. Every
    tensor float32 (the RoPE table complex64), contiguous, on the CPU."""

    def __init__(
        self,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
        final_norm: torch.Tensor,
        head: torch.Tensor,
        embed: torch.Tensor,
        rotary: torch.Tensor,
        num_heads: int,
        kv_heads: int,
        eps: float,
    ) -> None:
        input_norm, qkv, _, _, _, down = layers[0]
        hidden, qkv_out, inter, vocab = input_norm.shape[0], qkv.shape[1], down.shape[0], head.shape[1]
        self.head_dim, self.kv_heads, self.n_layers, self.vocab = 2 * rotary.shape[1], kv_heads, len(layers), vocab
        self.positions, q_width = rotary.shape[0], num_heads * self.head_dim
        shapes = ((hidden,), (hidden, qkv_out), (q_width, hidden), (hidden,), (hidden, 2 * inter), (inter, hidden))
        if qkv_out != q_width + 2 * kv_heads * self.head_dim or num_heads % kv_heads:
            raise ValueError("qkv's columns must be Hq + 2 Hkv heads, Hq a multiple of Hkv")
        for ws in layers:
            for t, shape in zip(ws, shapes):
                _check_weight(t, shape)
        _check_weight(final_norm, (hidden,))
        _check_weight(head, (hidden, vocab))
        if embed.dtype != torch.float32 or embed.device.type != "cpu" or embed.dim() != 2 or embed.shape[0] < vocab:
            raise ValueError("the embedding must be a float32 table on the CPU, a row a token")
        if embed.shape[1] != hidden or embed.stride(1) < 1 or embed.storage_offset():
            raise ValueError(f"the embedding's rows must be {hidden} wide")
        if rotary.dtype != torch.complex64 or not rotary.is_contiguous() or rotary.device.type != "cpu":
            raise ValueError("the RoPE table must be complex64 [positions, D/2] contiguous on the CPU")
        self._held = (layers, final_norm, head, embed, rotary)
        self._layers = (_LayerWeights * len(layers))(*(_LayerWeights(*(t.data_ptr() for t in ws)) for ws in layers))
        self.args = _StepArgs(
            layers=ctypes.addressof(self._layers),
            final_norm=final_norm.data_ptr(),
            head=head.data_ptr(),
            embed=embed.data_ptr(),
            rotary=rotary.data_ptr(),
            embed_row=embed.stride(0),
            embed_col=embed.stride(1),
            hidden=hidden,
            qkv_out=qkv_out,
            q_width=q_width,
            inter=inter,
            vocab=vocab,
            n_layers=len(layers),
            heads=num_heads,
            kv_heads=kv_heads,
            head_dim=self.head_dim,
            eps=eps,
        )
        self.scratch = torch.empty(0, dtype=torch.float32)  # grown to a step's need, then kept
        # Scratch floats a row needs: its key count (a long), activations and rotation; and
        # the attention's, groups x keys a thread (kv_decode_step's layout).
        self.row_floats = 2 + 2 * hidden + qkv_out + q_width + 2 * inter + self.head_dim
        self.groups = num_heads // kv_heads
        # The cache its steps write, checked once (``FusedOps._bind_cache``), and the bounds of a
        # step's indices by (rows, page width).
        self.cache_key: tuple[object, ...] = ()
        self.cache: torch.Tensor | None = None
        self.bounds: dict[tuple[int, int], np.ndarray] = {}


def _check_weight(t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(f"a weight must be float32 {shape} contiguous on the CPU, got {t.dtype} {tuple(t.shape)}")


class KVStore:
    """A step's K/V writes checked once (``FusedOps.kv_store_plan``) and run on each layer: a
    call sets the layer's qkv and cache pointers and passes one (the checks, and torch's four
    ops of a write, cost more than the copy at a small batch)."""

    def __init__(
        self, fn: Callable[[Any], None], args: _StoreArgs, cache: torch.Tensor, slots: torch.Tensor, qkv: torch.Tensor
    ) -> None:
        self._fn, self._args, self._ref = fn, args, ctypes.byref(args)
        self._layout = (qkv.shape, qkv.stride(), qkv.dtype)
        self._layers = cache.shape[0]
        self._base, self._layer_bytes = cache.data_ptr(), cache.stride(0) * cache.element_size()
        self._held = (cache, slots)  # the tensors behind args' pointers, held while the plan is

    def fits(self, qkv: torch.Tensor) -> bool:
        """Whether qkv is laid out as the plan's (every layer's projections are, in a step)."""
        return (qkv.shape, qkv.stride(), qkv.dtype) == self._layout

    def __call__(self, layer: int, qkv: torch.Tensor) -> None:
        """Write layer ``layer``'s K and V from ``qkv``, laid out as the plan's (the C code
        reads it by the plan's strides: any other layout is refused)."""
        if not self.fits(qkv) or not 0 <= layer < self._layers:
            raise ValueError("qkv not laid out as the plan's, or no such layer: make a plan for it")
        a = self._args
        a.qkv, a.cache = qkv.data_ptr(), self._base + layer * self._layer_bytes
        self._fn(self._ref)


class DecodeAttention:
    """A decode attention checked once (``FusedOps.decode_attention_plan``) and run on every
    layer of a step: only the queries, K/V and output move from layer to layer, so a call
    sets four pointers and passes one (the arguments' checks and conversion, once a layer,
    cost more than the attention itself at a small batch)."""

    def __init__(
        self,
        fn: Callable[[Any], None],
        args: _AttentionArgs,
        q3: torch.Tensor,
        kv: torch.Tensor,
        given: tuple[object, ...],
        scratch: torch.Tensor,
    ) -> None:
        self._fn, self._args, self._ref = fn, args, ctypes.byref(args)
        self._q_layout = (q3.shape, q3.stride())
        self._kv_layout = (kv.shape, kv.stride(), kv.dtype)
        self._v_offset = kv.stride(0) * kv.element_size()  # V's first element after K's
        # The tensors behind args' pointers, held while the plan is: and the plan's other
        # arguments, which ``matches`` compares by identity (a step's group tensors are built once).
        self._given, self._scratch = given, scratch

    def matches(self, q3: torch.Tensor, kv: torch.Tensor, *given: object) -> bool:
        """Whether this plan runs these arguments (``decode_attention_plan``'s, in its order):
        the same tensors but q3 and kv, and those laid out as the plan's."""
        if len(given) != len(self._given):
            return False
        for a, b in zip(given, self._given):  # a loop, not all(): this runs on every layer
            if a is not b and not (type(a) in (bool, int) and a == b):
                return False
        return (
            (q3.shape, q3.stride()) == self._q_layout
            and (kv.shape, kv.stride(), kv.dtype) == self._kv_layout
            and q3.dtype == torch.float32
        )

    def __call__(self, q3: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q3 and kv laid out as the plan's (``matches``: the C code reads them by the plan's
        strides, so any other layout is refused); returns q3's shape, a new tensor."""
        if (q3.shape, q3.stride()) != self._q_layout or (kv.shape, kv.stride(), kv.dtype) != self._kv_layout:
            raise ValueError("queries or K/V not laid out as the plan's: make a plan for them")
        out = torch.empty(self._q_layout[0], dtype=torch.float32)
        a = self._args
        a.q, a.out = q3.data_ptr(), out.data_ptr()
        a.k = kv.data_ptr()
        a.v = a.k + self._v_offset
        self._fn(self._ref)
        return out


@cache
def load() -> FusedOps | None:
    """The compiled ops, or None (logged once) where they cannot be built or are switched off."""
    if os.environ.get("KVFLEET_FUSED_OPS", "1") == "0":
        log.info("fused CPU ops off (KVFLEET_FUSED_OPS=0): torch's ops")
        return None
    try:
        found = native.locate(native.FUSED, torch_uses_libgomp())
        log.debug("fused CPU ops from %s (%s)", found.path, found.origin.value)
        return FusedOps(ctypes.CDLL(str(found.path)), found.path, found.origin)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("fused CPU ops unavailable, using torch's ops: %s", e)
        return None

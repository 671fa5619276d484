"""A small numpy quantizer into Q4_K and Q6_K, which the gguf package (0.19) reads but does not
write: the tests' way to make GGUF files in the K formats (``quantize``: those two here, the
others by the gguf package).

Not llama.cpp's search for the best scales (no iterations, no importance weights): each
sub-block's range is taken as it is (Q4_K: min and max of its 32; Q6_K: the largest |w| of its
16), the super-block's fp16 d (and dmin) is the largest of those over 63 (or 127), and each
weight is rounded against the scale the file will hold. A valid file in the layouts of
``kvfleet_models/gguf_blocks.py``, a little less accurate than llama.cpp's. (Rounding the
integer scales up instead, so that no weight clips, measured worse on SmolLM2's down_proj:
rms error 2.4 % against 1.8 % for Q4_K, 1.98 % against 1.95 % for Q6_K.)
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def quantize(w: np.ndarray, fmt: str) -> np.ndarray:
    """w float32 [N, K] -> uint8 [N, row bytes] in ``fmt`` (K a multiple of 256 for the K ones)."""
    if fmt == "Q4_K":
        return _rows(w, _q4_k)
    if fmt == "Q6_K":
        return _rows(w, _q6_k)
    import gguf

    return np.asarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt]))


def _rows(w: np.ndarray, kind) -> np.ndarray:  # type: ignore[no-untyped-def]
    n, k = w.shape
    if k % QK_K:
        raise ValueError(f"K formats need rows a multiple of {QK_K} wide, got {k}")
    return kind(w.astype(np.float32).reshape(-1, QK_K)).reshape(n, -1)


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _levels(target: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Per super-block scales target [S, G] (>= 0 for the unsigned, any sign for Q6_K) -> the
    fp16 d [S] and the integer levels [S, G] (|level| <= top) with d * level ~ target."""
    d = _fp16(np.abs(target).max(axis=1) / top)  # [S]
    inv = np.divide(1.0, d.astype(np.float32), out=np.zeros(d.shape, np.float32), where=d > 0)
    return d, np.clip(np.rint(target * inv[:, None]), -top, top)


def _q4_k(x: np.ndarray) -> np.ndarray:
    """[S, 256] -> [S, 144]."""
    s = x.shape[0]
    sub = x.reshape(s, 8, 32)
    lo, hi = np.minimum(sub.min(axis=2), 0.0), sub.max(axis=2)  # a sub-block's range holds 0 (m >= 0)
    d, sc = _levels((hi - lo) / 15.0, 63)
    dmin, mn = _levels(-lo, 63)
    scale = d.astype(np.float32)[:, None] * sc  # [S, 8]: what the file holds
    offset = dmin.astype(np.float32)[:, None] * mn
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.clip(np.rint((sub + offset[:, :, None]) * inv[:, :, None]), 0, 15).astype(np.uint8)  # [S, 8, 32]
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    packed = np.concatenate(
        [(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
         (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1,
    )  # fmt: skip
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(s, 128)  # sub-blocks 2i low, 2i + 1 high
    heads = np.concatenate([d.reshape(s, 1).view(np.uint8), dmin.reshape(s, 1).view(np.uint8)], axis=1)
    return np.concatenate([heads, packed, nibbles], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """[S, 256] -> [S, 210]."""
    s = x.shape[0]
    groups = x.reshape(s, 16, 16)
    d, sc = _levels(np.abs(groups).max(axis=2) / 31.0, 127)
    scale = d.astype(np.float32)[:, None] * sc  # [S, 16]
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    q = (np.clip(np.rint(groups * inv[:, :, None]), -32, 31) + 32).astype(np.uint8).reshape(s, 2, 4, 32)
    low, high = q & 15, q >> 4  # [S, half, chunk, 32]
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(s, 128)  # chunks 0, 1 low nibbles; 2, 3 high
    qh = (high << np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]).sum(axis=2, dtype=np.uint8).reshape(s, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d.reshape(s, 1).view(np.uint8)], axis=1)

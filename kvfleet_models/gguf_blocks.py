"""A GGUF weight kept in its file's quantized blocks (``--quant gguf``), and our own reading of
those blocks, for the formats the worker's block products run (``worker_svc/model/gguf_quant``).

llama.cpp's layouts (ggml-common.h), a row of K weights being K / (weights a block) blocks one
after the other. 32 weights a block:
  * Q8_0, 34 bytes: fp16 d, then 32 int8 q;                 w = d * q
  * Q4_0, 18 bytes: fp16 d, then 16 bytes of nibbles;       w = d * (q - 8)
  * Q4_1, 20 bytes: fp16 d, fp16 m, then 16 bytes;          w = d * q + m
where byte j of the nibbles holds weight j in its low four bits and weight j + 16 in its
high four. The K formats, 256 weights a super-block:
  * Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc and mins m for 8
    sub-blocks of 32, then 128 bytes of nibbles; w = d sc_j q - dmin m_j in sub-block j.
    Bytes 0-3 hold sc_0..3 in their low six bits, 4-7 m_0..3, 8-11 sc_4..7 (low nibble) and
    m_4..7 (high), whose top two bits are those of bytes 0-3 (sc) and 4-7 (m). Nibble byte
    32 i + l holds weight 64 i + l low and 64 i + 32 + l high;
  * Q6_K, 210 bytes: 128 bytes ql (low four bits), 64 bytes qh (high two), 16 int8 scales
    (one per 16 weights), fp16 d; w = d sc_(e / 16) (q - 32). In half h (128 weights) chunk
    c (32 weights, e = 128 h + 32 c + l) takes ql[64 h + 32 (c & 1) + l] (low nibble for
    c < 2, high for c >= 2) and bits 2c, 2c + 1 of qh[32 h + l].
Numpy only (no torch, no gguf): the loaders' package.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # weights per block of the activations, and of the weights' formats but the K ones
QK_K = 256  # weights per super-block of the K formats


@dataclass(frozen=True)
class BlockFormat:
    name: str  # GGML's name (gguf.GGMLQuantizationType member)
    code: int  # the C kernels' number for it (gguf_kernels.c)
    block_bytes: int
    block_weights: int = QK


FORMATS = {
    f.name: f
    for f in (
        BlockFormat("Q8_0", 0, 34),
        BlockFormat("Q4_0", 1, 18),
        BlockFormat("Q4_1", 2, 20),
        BlockFormat("Q4_K", 3, 144, QK_K),
        BlockFormat("Q6_K", 4, 210, QK_K),
    )
}


@dataclass(frozen=True, eq=False)
class BlockTensor:
    """A weight [rows, cols] in one block format: ``data`` uint8 [rows, cols / 32 * block
    bytes], each row its blocks as they lie in the file (HF's row order: the loader applies row
    permutations to whole rows, which never cross a block)."""

    format: BlockFormat
    data: np.ndarray
    cols: int

    def __post_init__(self) -> None:
        per = self.format.block_weights
        if self.cols % per or self.data.dtype != np.uint8 or self.data.ndim != 2:
            raise ValueError(f"{self.format.name} rows need cols a multiple of {per} and uint8 [rows, bytes]")
        if self.data.shape[1] != self.cols // per * self.format.block_bytes:
            raise ValueError(f"{self.format.name}: {self.data.shape[1]} bytes a row, {self.cols} columns")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def take_rows(self, index: np.ndarray) -> BlockTensor:
        """The rows ``index`` [R] (a permutation or a selection), as a new tensor."""
        return BlockTensor(self.format, np.ascontiguousarray(self.data[index]), self.cols)

    def dequantize(self, rows: np.ndarray | None = None, dtype: type = np.float32) -> np.ndarray:
        """[R, cols] of ``rows`` (all by default) in ``dtype`` (float64: the tests' reference)."""
        data = self.data if rows is None else self.data[rows]
        return dequantize_rows(self.format, data, self.cols, dtype)


def dequantize_rows(fmt: BlockFormat, data: np.ndarray, cols: int, dtype: type = np.float32) -> np.ndarray:
    """data: uint8 [R, row bytes] of ``fmt`` -> [R, cols] in ``dtype``."""
    if fmt.name in _K_READERS:
        sb = data.reshape(-1, fmt.block_bytes)  # [R * cols / 256, bytes]
        return _K_READERS[fmt.name](sb, dtype).reshape(data.shape[0], cols)
    r, nb = data.shape[0], cols // QK
    blocks = data.reshape(r, nb, fmt.block_bytes)
    d: np.ndarray = blocks[:, :, 0:2].copy().view(np.float16).astype(dtype)  # [R, nb, 1]
    if fmt.name == "Q8_0":
        q: np.ndarray = blocks[:, :, 2:].view(np.int8).astype(dtype)  # [R, nb, 32]
        return (d * q).reshape(r, cols)
    nib = blocks[:, :, fmt.block_bytes - 16 :]  # [R, nb, 16]
    q = np.concatenate([nib & 15, nib >> 4], axis=2).astype(dtype)  # [R, nb, 32]: low nibbles first
    if fmt.name == "Q4_0":
        return (d * (q - 8.0)).reshape(r, cols)
    m: np.ndarray = blocks[:, :, 2:4].copy().view(np.float16).astype(dtype)
    return (d * q + m).reshape(r, cols)


def _half(b: np.ndarray, dtype: type) -> np.ndarray:
    """uint8 [..., 2] little-endian fp16 -> [..., 1] in ``dtype``."""
    return np.ascontiguousarray(b).view(np.float16).astype(dtype)


def q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [S, 12] -> (scales, mins), uint8 [S, 8] each (values 0..63)."""
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _read_q4_k(sb: np.ndarray, dtype: type) -> np.ndarray:
    """[S, 144] -> [S, 256]. The products d sc and dmin m are exact in float32 (11 x 6 bits), so
    float32 equals the gguf package's reading and float64 is exact."""
    d, dmin = _half(sb[:, 0:2], dtype), _half(sb[:, 2:4], dtype)  # [S, 1]
    sc, mn = q4_k_scales(sb[:, 4:16])
    qs = sb[:, 16:].reshape(-1, 4, 1, 32)  # [S, 4 pairs of sub-blocks, low/high, 32]
    q: np.ndarray = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32).astype(dtype)
    return ((d * sc.astype(dtype))[:, :, None] * q - (dmin * mn.astype(dtype))[:, :, None]).reshape(-1, QK_K)


def _read_q6_k(sb: np.ndarray, dtype: type) -> np.ndarray:
    """[S, 210] -> [S, 256]."""
    ql = sb[:, 0:128].reshape(-1, 2, 1, 2, 32)  # [S, half, -, c & 1, 32]
    qh = sb[:, 128:192].reshape(-1, 2, 1, 32)  # [S, half, -, 32]
    low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(-1, 2, 4, 32)  # chunk c = 2 (c >> 1) + (c & 1)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # [S, half, chunk, 32]
    q = (low | (high << 4)).astype(dtype).reshape(-1, 16, 16) - 32.0
    sc: np.ndarray = sb[:, 192:208].view(np.int8).astype(dtype)  # [S, 16]
    d = _half(sb[:, 208:210], dtype)
    return ((d * sc)[:, :, None] * q).reshape(-1, QK_K)


_K_READERS = {"Q4_K": _read_q4_k, "Q6_K": _read_q6_k}

"""A GGUF weight kept in its file's quantized blocks (``--quant gguf``), and our own reading of
those blocks, for the formats the worker's block products run (``worker_svc/model/gguf_quant``).

llama.cpp's layouts (ggml-common.h), 32 weights a block, a row of K weights being K / 32
blocks one after the other:
  * Q8_0, 34 bytes: fp16 d, then 32 int8 q;                 w = d * q
  * Q4_0, 18 bytes: fp16 d, then 16 bytes of nibbles;       w = d * (q - 8)
  * Q4_1, 20 bytes: fp16 d, fp16 m, then 16 bytes;          w = d * q + m
where byte j of the nibbles holds weight j in its low four bits and weight j + 16 in its
high four. Numpy only (no torch, no gguf): the loaders' package.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # weights per block in every format here


@dataclass(frozen=True)
class BlockFormat:
    name: str  # GGML's name (gguf.GGMLQuantizationType member)
    code: int  # the C kernels' number for it (gguf_kernels.c)
    block_bytes: int


FORMATS = {f.name: f for f in (BlockFormat("Q8_0", 0, 34), BlockFormat("Q4_0", 1, 18), BlockFormat("Q4_1", 2, 20))}


@dataclass(frozen=True, eq=False)
class BlockTensor:
    """A weight [rows, cols] in one block format: ``data`` uint8 [rows, cols / 32 * block
    bytes], each row its blocks as they lie in the file (HF's row order: the loader applies row
    permutations to whole rows, which never cross a block)."""

    format: BlockFormat
    data: np.ndarray
    cols: int

    def __post_init__(self) -> None:
        if self.cols % QK or self.data.dtype != np.uint8 or self.data.ndim != 2:
            raise ValueError(f"{self.format.name} rows need cols a multiple of {QK} and uint8 [rows, bytes]")
        if self.data.shape[1] != self.cols // QK * self.format.block_bytes:
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

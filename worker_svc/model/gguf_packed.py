"""A GGUF weight's blocks in groups of 16 rows (the SIMD levels' layout for Q8_0, Q4_0, Q4_1).

The same bytes as the file's blocks, in another order: for each group of 16 rows and each
block position b, the 16 rows' fp16 d side by side (32 bytes), for Q4_1 their fp16 m (32
bytes), then the payload in chunks of four bytes a row: chunk c holds bytes 4c..4c+3 of each
of the 16 rows' block b, row after row (64 bytes a chunk; Q4 blocks have 4 chunks of
nibbles, Q8_0 blocks 8 of values). One 512-bit load is then one chunk of 16 rows, and one
vpdpbusd against four activations broadcast multiplies the 16 rows at once, each 32-bit
lane a row (``gguf_kernels.c``, ``kv_gguf_gemm16_*``); the rows' scales load as one vector.
The last ``rows % 16`` rows stay in the file's layout after the groups.

A ``RowGroups`` reads as a ``BlockTensor`` does (``format``, ``cols``, ``shape``, ``nbytes``,
``dequantize``, and ``data``: the file's bytes, rebuilt on each read, for checks only), so
the reference product and the tied embedding's lookup need not know the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvfleet_models.gguf_blocks import QK, BlockFormat, BlockTensor, dequantize_rows

GROUP = 16  # rows a group: the 32-bit lanes of a 512-bit register
GROUPED_FORMATS = frozenset({"Q8_0", "Q4_0", "Q4_1"})


def _head_bytes(fmt: BlockFormat) -> int:
    """Bytes of a block before its payload: fp16 d (and Q4_1's fp16 m)."""
    return fmt.block_bytes - (QK if fmt.name == "Q8_0" else QK // 2)


@dataclass(frozen=True, eq=False)
class RowGroups:
    """``BlockTensor`` rows, the first ``rows // 16 * 16`` of them grouped (module doc)."""

    format: BlockFormat
    packed: np.ndarray  # uint8 [groups * group bytes + tail rows * row bytes]
    rows: int
    cols: int

    @property
    def groups(self) -> int:
        return self.rows // GROUP

    @property
    def row_bytes(self) -> int:
        return self.cols // QK * self.format.block_bytes

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes)

    @property
    def data(self) -> np.ndarray:
        """The file's bytes, uint8 [rows, row bytes] (a copy, made on each read)."""
        return self.file_rows(np.arange(self.rows))

    def file_rows(self, index: np.ndarray) -> np.ndarray:
        """uint8 [R, row bytes]: rows ``index`` in the file's layout."""
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        fmt, nb, head = self.format, self.cols // QK, _head_bytes(self.format)
        body_rows = self.groups * GROUP
        out = np.empty((index.size, nb, fmt.block_bytes), dtype=np.uint8)
        grouped = index < body_rows
        if grouped.any():
            g, lane = index[grouped] // GROUP, index[grouped] % GROUP
            body = self.packed[: self.groups * nb * GROUP * fmt.block_bytes].reshape(self.groups, nb, -1)[g]
            fields = body[:, :, : GROUP * head].reshape(-1, nb, head // 2, GROUP, 2)
            chunks = body[:, :, GROUP * head :].reshape(-1, nb, (fmt.block_bytes - head) // 4, GROUP, 4)
            picked = np.arange(g.size)
            out[grouped, :, :head] = fields[picked, :, :, lane].reshape(-1, nb, head)
            out[grouped, :, head:] = chunks[picked, :, :, lane].reshape(-1, nb, fmt.block_bytes - head)
        if not grouped.all():
            tail = self.packed[self.groups * nb * GROUP * fmt.block_bytes :].reshape(-1, nb, fmt.block_bytes)
            out[~grouped] = tail[index[~grouped] - body_rows]
        return out.reshape(index.size, -1)

    def dequantize(self, rows: np.ndarray | None = None, dtype: type = np.float32) -> np.ndarray:
        """[R, cols] of ``rows`` (all by default) in ``dtype``, as ``BlockTensor.dequantize``."""
        data = self.data if rows is None else self.file_rows(rows)
        return dequantize_rows(self.format, data, self.cols, dtype)


def group_rows(t: BlockTensor) -> RowGroups:
    """``t``'s bytes in the grouped layout (one copy; ``t`` is left as it was)."""
    if t.format.name not in GROUPED_FORMATS:
        raise ValueError(f"{t.format.name} blocks are not grouped (only {sorted(GROUPED_FORMATS)})")
    rows, nb, bb, head = t.shape[0], t.cols // QK, t.format.block_bytes, _head_bytes(t.format)
    groups = rows // GROUP
    body = t.data[: groups * GROUP].reshape(groups, GROUP, nb, bb)
    fields = body[..., :head].reshape(groups, GROUP, nb, head // 2, 2).transpose(0, 2, 3, 1, 4)
    chunks = body[..., head:].reshape(groups, GROUP, nb, (bb - head) // 4, 4).transpose(0, 2, 3, 1, 4)
    grouped = np.concatenate(
        [fields.reshape(groups, nb, GROUP * head), chunks.reshape(groups, nb, GROUP * (bb - head))], 2
    )
    packed = np.concatenate([grouped.reshape(-1), t.data[groups * GROUP :].reshape(-1)])
    return RowGroups(t.format, packed, rows, t.cols)

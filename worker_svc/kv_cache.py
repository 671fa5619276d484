"""Device memory of the paged KV cache, and the two ways of handing attention contiguous K/V.

The paged cache is the source of truth: every new token's K/V is written to its slot (the
block/offset pair the scheduler's block tables chose: ``kvfleet_common.kv_blocks``). Attention
wants, per session, K/V as one contiguous run of positions, padded to a common length across a
batch; a *views*
object produces that, in one of two ways (``kv_views``):

- ``RebuildViews`` ("rebuild", the control): every layer of every step hands attention the
  group's blocks (``PagedRows``). The fused decode attention (CPU) reads them where they lie,
  as a paged-attention kernel does; every other path (prefill chunks, torch's ops, GPUs)
  gathers each session's blocks into fresh padded tensors, a copy of the group's whole
  context per layer.
- ``PersistentViews`` ("persistent", the candidate): each session owns a row of a persistent
  slab that outlives the step; a step appends only its new tokens to the rows, and attention
  reads a slice of the slab (no copy when the group's rows are consecutive). Cost per decode
  step is the new tokens, plus growth (amortised by doubling) and a row gather when a group's
  sessions are not a contiguous run of rows.

A step's items are split into two attention *groups* (``BatchLayout.num_multi``): items with
several new tokens (prefill chunks) first, then items with one new token (decodes, and prefill
chunks of one token). Each group is one batched attention; a group's K/V come as one tensor
``[2, N, S, D]`` (K and V stacked; N = items x kv heads in the order ``AttnGroup.order`` names)
so that attention is a plain ``bmm`` with no copy of K/V.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.kv_views_mode import KVViewsMode


@dataclass(frozen=True)
class BatchLayout:
    """Which sessions a step runs and where their tokens go; built on the host once per step.

    Items are ordered multi-token items first (``num_multi`` of them), then one-token items.
    """

    session_ids: tuple[str, ...]
    starts: tuple[int, ...]  # tokens already cached before this step, per item
    lengths: tuple[int, ...]  # new (query) tokens this step, per item
    block_tables: tuple[tuple[int, ...], ...]  # blocks per item after this step's append
    num_multi: int = 0  # items [0, num_multi) have lengths > 1

    @functools.cached_property
    def totals(self) -> tuple[int, ...]:
        # Cached: per-item loops read it once per item (it was O(items^2) at large batches).
        return tuple(s + n for s, n in zip(self.starts, self.lengths))

    @property
    def max_total(self) -> int:
        return max(self.totals)

    def group_items(self) -> tuple[range, range]:
        """(multi-token items, one-token items); either may be empty."""
        return range(0, self.num_multi), range(self.num_multi, len(self.session_ids))


@dataclass(frozen=True)
class AttnGroup:
    """How a views object lays one group's K/V out for attention."""

    items: range  # the group's items in the layout
    order: str  # "bh": K/V batch axis is (item, kv head); "hb": (kv head, item)
    kv_len: int  # S: keys per item, padded; keys at or past an item's total are junk
    # Position of each item in the attention batch, or None when it is the layout order.
    perm: tuple[int, ...] | None = None


@dataclass(frozen=True)
class BlockTable:
    """A group's blocks in the paged cache, built once a step and read by every layer."""

    ids: torch.Tensor  # int64 [B, W]: each item's blocks in order, padded with block 0
    block_size: int
    keys: int  # S: keys per item, padded (at most W * block_size)
    max_id: int  # the largest id, for the fused attention's bounds check (no device read per layer)


@dataclass(frozen=True)
class PagedRows:
    """A group's K/V left in the paged cache: the layer's ``kv`` [2, Hkv, slots, D] and the
    group's blocks. The fused decode attention reads the blocks where they lie; ``merged``
    gathers them (a copy of every item's context, per layer: 33 ms a step at batch 32 with
    220-token contexts on SmolLM2 in float32, measured on the 2-core Xeon)."""

    cache: PagedKVCache
    layer: int
    table: BlockTable

    @property
    def kv(self) -> torch.Tensor:
        return self.cache.kv[self.layer]

    def merged(self) -> torch.Tensor:
        """[2, Hkv * B, S, D] in "hb" order: whole blocks, cut to S (a view of the copy), so
        that both views modes run attention over the same S and agree to the last bit."""
        return self.cache.gather_blocks(self.layer, self.table)[:, :, : self.table.keys]


class PagedKVCache:
    """K and V for every layer: ``kv`` [num_layers, 2, num_kv_heads, num_blocks * block_size, D].

    Float32, or float16 for the reduced-precision CPU modes (``platform.kv_cache_dtype``).
    Head-major, with the block and offset axes merged into one slot axis: a write is a single
    ``index_copy_`` of the step's new tokens and a gather of whole blocks is a single
    ``index_select`` whose result is already [2, heads x items, S, D], the layout ``bmm``
    wants. Zero-initialised, not ``empty``: padded attention reads stale slots under a mask,
    and a NaN from uninitialised memory would survive the mask (NaN * 0 is NaN).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv = torch.zeros(
            (num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim), dtype=dtype, device=device
        )

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, 0]  # [L, Hkv, slots, D]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, 1]

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """slots: [T] long; kv: [T, 2, Hkv, D] (K then V of each new token), in the cache's
        dtype (``LlamaModel.forward`` converts once for the cache and the views)."""
        self.kv[layer].index_copy_(2, slots, kv.permute(1, 2, 0, 3))

    def block_table(self, block_tables: tuple[tuple[int, ...], ...], keys: int) -> BlockTable:
        """The items' blocks covering ``keys`` keys each, every table padded with block 0 (junk,
        masked or never read)."""
        blocks = -(-keys // self.block_size)
        table = np.zeros((len(block_tables), blocks), dtype=np.int64)
        for row, t in zip(table, block_tables):
            row[: len(t)] = t
        ids = torch.from_numpy(table).to(self.kv.device)
        return BlockTable(ids, self.block_size, keys, int(table.max(initial=0)))

    def gather_blocks(self, layer: int, table: BlockTable) -> torch.Tensor:
        """K/V of the table's whole blocks: [2, Hkv * items, blocks * block_size, D] ("hb" order)."""
        src = self.kv[layer]  # [2, Hkv, slots, D]
        two, hkv, _, d = src.shape
        by_block = src.view(two, hkv, self.num_blocks, self.block_size, d)
        got = by_block.index_select(2, table.ids.view(-1))  # [2, Hkv, B * blocks, bs, D]
        return got.view(two, hkv * table.ids.shape[0], -1, d)

    def gather_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Every layer's K/V of the given slots: [L, 2, Hkv, len(slots), D]."""
        return self.kv.index_select(3, slots)


class RebuildViews:
    """Nothing kept between steps: each group's K/V are the sessions' blocks of the paged cache."""

    order = "hb"
    copies_new_tokens = False  # ``append`` does nothing: the caller need not make its argument

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self._groups: list[BlockTable] = []

    def begin_step(self, layout: BatchLayout) -> list[AttnGroup]:
        groups, self._groups = [], []
        for items in layout.group_items():
            if not items:
                continue
            kv_len = max(layout.totals[i] for i in items)
            self._groups.append(self.cache.block_table(tuple(layout.block_tables[i] for i in items), kv_len))
            groups.append(AttnGroup(items, self.order, kv_len))
        return groups

    def append(self, layer: int, kv: torch.Tensor) -> None:
        """Nothing to do: the new tokens are already in the paged cache."""

    def keys_values(self, layer: int, group: int) -> PagedRows:
        """The group-th group of ``begin_step``, left in the cache: ``PagedRows.merged`` makes
        it [2, Hkv * B, S, D] for a caller that cannot read the blocks where they lie."""
        return PagedRows(self.cache, layer, self._groups[group])

    def release(self, session_id: str) -> None:
        """Nothing is kept between steps."""

    def holds(self, session_id: str) -> bool:
        return False


@dataclass(frozen=True)
class SlabRows:
    """A group's K/V left in the persistent slab: ``slab`` [2, R, Hkv, S, D] and the group's
    rows (int64 [B], ascending). The fused decode attention reads the rows where they lie;
    ``merged`` gathers them (a copy of every row: at c=32 with prefills mixed in, the decode
    group's scattered rows made this gather a tenth of a step)."""

    slab: torch.Tensor
    rows: torch.Tensor

    def merged(self) -> torch.Tensor:
        kv = self.slab[:, self.rows]
        two, b, hkv, s, d = kv.shape
        return kv.reshape(two, b * hkv, s, d)


class PersistentViews:
    """Per-session contiguous K/V kept across steps, as the rows of one slab.

    Slab: [num_layers, 2, rows, Hkv, capacity, D]. One slab rather than a tensor per session
    so that a group of sessions sitting in consecutive rows is a *view*
    (``slab[l, :, r0:r1, :, :S]``, whose (row, head) axes merge into one batch axis) and
    attention stays one batched call with no copy. Rows are kept dense (a released row is
    filled by moving the last row into it), so a steady decode batch of all active sessions
    is always consecutive. Rows and capacity grow by doubling, so growth copies are amortised;
    the price is that every row is as long as the longest session's capacity.
    """

    order = "bh"
    copies_new_tokens = True  # ``append`` copies the step's new K/V into the sessions' rows

    def __init__(self, cache: PagedKVCache, rows: int = 4, capacity: int | None = None) -> None:
        self.cache = cache
        capacity = capacity or cache.block_size  # small: doubling finds the working size
        self.slab = self._zeros(rows, capacity)
        self._row: dict[str, int] = {}
        self._len: dict[str, int] = {}  # tokens present in the session's row
        self._sessions: list[str] = []  # session of each used row (rows are dense)
        # Per group of this step: (first row, last row + 1) when consecutive, else the rows.
        self._groups: list[tuple[int, int] | torch.Tensor] = []
        self._lengths: list[int] = []  # this step's padded key length per group
        self._tok_rows: torch.Tensor | None = None  # [T] row of each new token
        self._tok_pos: torch.Tensor | None = None  # [T] position of each new token

    def _zeros(self, rows: int, capacity: int) -> torch.Tensor:
        num_layers, two, hkv, _, d = self.cache.kv.shape
        return torch.zeros(
            (num_layers, two, rows, hkv, capacity, d), dtype=self.cache.kv.dtype, device=self.cache.kv.device
        )

    def _grow(self, rows: int, capacity: int) -> None:
        old_rows, old_cap = self.slab.shape[2], self.slab.shape[4]
        if rows <= old_rows and capacity <= old_cap:
            return
        new_rows, new_cap = old_rows, old_cap
        while new_rows < rows:
            new_rows *= 2
        while new_cap < capacity:
            new_cap *= 2
        slab = self._zeros(new_rows, new_cap)
        slab[:, :, :old_rows, :, :old_cap] = self.slab
        self.slab = slab

    def _add_row(self, session_id: str) -> None:
        self._row[session_id] = len(self._sessions)
        self._len[session_id] = 0
        self._sessions.append(session_id)

    def begin_step(self, layout: BatchLayout) -> list[AttnGroup]:
        stale = []
        for sid, start, table in zip(layout.session_ids, layout.starts, layout.block_tables):
            if sid not in self._row:
                self._add_row(sid)
            if self._len[sid] != start:
                stale.append((sid, start, table))
        self._grow(len(self._sessions), layout.max_total)  # rows and length, by doubling
        for sid, start, table in stale:
            # The session was stepped under the other kv_views mode (the engine switches per
            # step): refill its row from the paged cache, the source of truth.
            bs = self.cache.block_size
            slots = [table[p // bs] * bs + p % bs for p in range(start)]
            idx = torch.tensor(slots, dtype=torch.long, device=self.slab.device)
            self.slab[:, :, self._row[sid], :, :start] = self.cache.gather_slots(idx)
            self._len[sid] = start
        rows = [self._row[sid] for sid in layout.session_ids]
        for sid, total in zip(layout.session_ids, layout.totals):
            self._len[sid] = total
        groups: list[AttnGroup] = []
        self._groups, self._lengths = [], []
        for items in layout.group_items():
            if not items:
                continue
            mine = [rows[i] for i in items]
            # Attention runs over the group's rows in row order, so consecutive rows are a slice.
            ordered = sorted(mine)
            if ordered[-1] - ordered[0] + 1 == len(ordered):
                self._groups.append((ordered[0], ordered[-1] + 1))
            else:
                self._groups.append(torch.tensor(ordered, device=self.slab.device))
            kv_len = max(layout.totals[i] for i in items)
            self._lengths.append(kv_len)
            rank = {r: i for i, r in enumerate(ordered)}
            perm = None if mine == ordered else tuple(rank[r] for r in mine)
            groups.append(AttnGroup(items, self.order, kv_len, perm))
        self._tok_rows = torch.tensor(np.repeat(rows, layout.lengths), device=self.slab.device)
        self._tok_pos = torch.tensor(
            np.concatenate([np.arange(s, s + n) for s, n in zip(layout.starts, layout.lengths)]),
            device=self.slab.device,
        )
        return groups

    def append(self, layer: int, kv: torch.Tensor) -> None:
        """Copy only this step's new tokens into their rows. kv: [T, 2, Hkv, D]."""
        self.slab[layer][:, self._tok_rows, :, self._tok_pos] = kv

    def keys_values(self, layer: int, group: int) -> torch.Tensor | SlabRows:
        """[2, B * Hkv, S, D] for the group-th group of ``begin_step``, a view, when its rows are
        consecutive; else the slab and the rows (``SlabRows``), gathered only by a caller that
        cannot read them where they lie."""
        where, length = self._groups[group], self._lengths[group]
        slab = self.slab[layer]  # [2, rows, Hkv, cap, D]
        if not isinstance(where, tuple):
            return SlabRows(slab[:, :, :, :length], where)
        kv = slab[:, where[0] : where[1], :, :length]
        two, b, hkv, s, d = kv.shape
        return kv.reshape(two, b * hkv, s, d)  # a view: (row, head) strides merge

    def release(self, session_id: str) -> None:
        row = self._row.pop(session_id, None)
        if row is None:
            return
        del self._len[session_id]
        last_sid = self._sessions.pop()
        if last_sid != session_id:
            # Keep rows dense: move the last row into the hole (one session's tokens).
            n = self._len[last_sid]
            last = len(self._sessions)
            self.slab[:, :, row, :, :n] = self.slab[:, :, last, :, :n]
            self._sessions[row] = last_sid
            self._row[last_sid] = row

    def holds(self, session_id: str) -> bool:
        return session_id in self._row


KVViews = RebuildViews | PersistentViews


def make_views(mode: KVViewsMode, cache: PagedKVCache) -> KVViews:
    if mode is KVViewsMode.REBUILD:
        return RebuildViews(cache)
    return PersistentViews(cache)

"""Device memory of the paged KV cache, and the two ways of handing attention contiguous K/V.

The paged cache is the source of truth: every new token's K/V is written to its slot (the
block/offset pair chosen by ``block_allocator.KVBookkeeper``). Attention wants, per session,
K/V as one contiguous run of positions, padded to a common length across the batch; a *views*
object produces that, in one of two ways (``kv_views``):

- ``RebuildViews`` ("rebuild", the control): every layer of every step gathers each session's
  K/V from its blocks into fresh padded tensors. Cost grows with the total context per step.
- ``PersistentViews`` ("persistent", the candidate): each session owns a row of a persistent
  slab that outlives the step; a step appends only its new tokens to the rows, and attention
  reads a slice of the slab. Cost per decode step is the new tokens, plus growth (amortised by
  doubling) and a row gather when the step's sessions are not a contiguous run of rows.

Both produce K/V of shape [B, S, Hkv, D] in the batch order they return from ``begin_step``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchLayout:
    """Which sessions a step runs and where their tokens go; built on the host once per step."""

    session_ids: tuple[str, ...]
    starts: tuple[int, ...]                  # tokens already cached before this step, per item
    lengths: tuple[int, ...]                 # new (query) tokens this step, per item
    block_tables: tuple[tuple[int, ...], ...]  # blocks per item after this step's append

    @property
    def totals(self) -> tuple[int, ...]:
        return tuple(s + n for s, n in zip(self.starts, self.lengths))

    @property
    def max_total(self) -> int:
        return max(self.totals)


class PagedKVCache:
    """K and V for every layer: [num_layers, num_blocks * block_size, num_kv_heads, head_dim].

    The block and offset axes are merged into one slot axis, so a write is a single
    ``index_copy_`` of the step's new tokens and a gather is a single index. Zero-initialised,
    not ``empty``: padded attention reads stale slots under a mask, and a NaN from
    uninitialised memory would survive the mask (NaN * 0 is NaN).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [T] long; k, v: [T, Hkv, D]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def gather_index(self, block_tables: tuple[tuple[int, ...], ...], length: int) -> torch.Tensor:
        """Slot of position j of session b, [B, length]; beyond a session's end it is junk."""
        width = max(len(t) for t in block_tables)
        table = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables],
                             dtype=torch.long)                                 # [B, blocks]
        pos = torch.arange(length)
        idx = table[:, pos // self.block_size] * self.block_size + pos % self.block_size
        return idx.to(self.k.device)


class RebuildViews:
    """Gather every session's whole context from the paged cache, every layer, every step."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self._idx: torch.Tensor | None = None    # [B, S] slots

    def begin_step(self, layout: BatchLayout) -> list[int]:
        self._idx = self.cache.gather_index(layout.block_tables, layout.max_total)
        return list(range(len(layout.session_ids)))

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Nothing to do: the new tokens are already in the paged cache."""

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._idx is not None, "begin_step first"
        return self.cache.k[layer][self._idx], self.cache.v[layer][self._idx]  # [B, S, Hkv, D]

    def release(self, session_id: str) -> None:
        """Nothing is kept between steps."""

    def holds(self, session_id: str) -> bool:
        return False


class PersistentViews:
    """Per-session contiguous K/V kept across steps, as the rows of one slab per layer.

    Slab: [num_layers, rows, capacity, Hkv, D]. One slab rather than a tensor per session so
    that a batch of sessions sitting in consecutive rows is a *view* (``slab[l, r0:r1, :S]``)
    and attention stays one batched call with no copy. Rows are kept dense (a released row is
    filled by moving the last row into it), so a steady decode batch of all active sessions
    is always consecutive. Rows and capacity grow by doubling, so growth copies are amortised;
    the price is that every row is as long as the longest session's capacity.
    """

    def __init__(self, cache: PagedKVCache, rows: int = 4, capacity: int | None = None) -> None:
        self.cache = cache
        capacity = capacity or cache.block_size   # small: doubling finds the working size
        _, _, hkv, d = cache.k.shape
        self._shape_tail = (hkv, d)
        self.k = self._zeros(rows, capacity)
        self.v = self._zeros(rows, capacity)
        self._row: dict[str, int] = {}
        self._len: dict[str, int] = {}            # tokens present in the session's row
        self._sessions: list[str] = []            # session of each used row (rows are dense)
        self._span: tuple[int, int] | None = None  # this step's rows, when consecutive
        self._rows: torch.Tensor | None = None     # [B] rows otherwise
        self._length = 0                           # this step's padded key length
        self._tok_rows: torch.Tensor | None = None  # [T] row of each new token
        self._tok_pos: torch.Tensor | None = None   # [T] position of each new token

    def _zeros(self, rows: int, capacity: int) -> torch.Tensor:
        num_layers = self.cache.k.shape[0]
        return torch.zeros((num_layers, rows, capacity, *self._shape_tail),
                           dtype=self.cache.k.dtype, device=self.cache.k.device)

    def _grow(self, rows: int, capacity: int) -> None:
        old_rows, old_cap = self.k.shape[1], self.k.shape[2]
        rows, capacity = max(rows, old_rows), max(capacity, old_cap)
        if (rows, capacity) == (old_rows, old_cap):
            return
        while old_rows < rows:
            old_rows *= 2
        while old_cap < capacity:
            old_cap *= 2
        k, v = self._zeros(old_rows, old_cap), self._zeros(old_rows, old_cap)
        k[:, : self.k.shape[1], : self.k.shape[2]] = self.k
        v[:, : self.v.shape[1], : self.v.shape[2]] = self.v
        self.k, self.v = k, v

    def _add_row(self, session_id: str) -> None:
        self._row[session_id] = len(self._sessions)
        self._len[session_id] = 0
        self._sessions.append(session_id)

    def begin_step(self, layout: BatchLayout) -> list[int]:
        stale = []
        for sid, start, table in zip(layout.session_ids, layout.starts, layout.block_tables):
            if sid not in self._row:
                self._add_row(sid)
            if self._len[sid] != start:
                stale.append((sid, start, table))
        self._grow(len(self._sessions), layout.max_total)   # rows and length, by doubling
        for sid, start, table in stale:
            # The session was stepped under the other kv_views mode (the engine switches per
            # step): refill its row from the paged cache, the source of truth.
            idx = self.cache.gather_index((table,), start)[0]            # [start] slots
            row = self._row[sid]
            self.k[:, row, :start] = self.cache.k[:, idx]
            self.v[:, row, :start] = self.cache.v[:, idx]
            self._len[sid] = start
        rows = [self._row[sid] for sid in layout.session_ids]
        for sid, total in zip(layout.session_ids, layout.totals):
            self._len[sid] = total
        # Attention runs over the step's rows in row order, so consecutive rows are a slice.
        ordered = sorted(rows)
        if ordered == list(range(ordered[0], ordered[0] + len(ordered))):
            self._span, self._rows = (ordered[0], ordered[-1] + 1), None
        else:
            self._span, self._rows = None, torch.tensor(ordered, device=self.k.device)
        self._length = layout.max_total
        rank = {row: i for i, row in enumerate(ordered)}
        self._tok_rows = torch.tensor(
            [r for r, n in zip(rows, layout.lengths) for _ in range(n)], device=self.k.device)
        self._tok_pos = torch.tensor(
            [p for s, n in zip(layout.starts, layout.lengths) for p in range(s, s + n)],
            device=self.k.device)
        return [rank[r] for r in rows]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy only this step's new tokens into their rows. k, v: [T, Hkv, D]."""
        self.k[layer, self._tok_rows, self._tok_pos] = k
        self.v[layer, self._tok_rows, self._tok_pos] = v

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._span is not None:
            r0, r1 = self._span
            return self.k[layer, r0:r1, : self._length], self.v[layer, r0:r1, : self._length]
        assert self._rows is not None, "begin_step first"
        return (self.k[layer, self._rows, : self._length],
                self.v[layer, self._rows, : self._length])

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
            self.k[:, row, :n] = self.k[:, last, :n]
            self.v[:, row, :n] = self.v[:, last, :n]
            self._sessions[row] = last_sid
            self._row[last_sid] = row

    def holds(self, session_id: str) -> bool:
        return session_id in self._row


KVViews = RebuildViews | PersistentViews


def make_views(kind: str, cache: PagedKVCache) -> KVViews:
    if kind == "rebuild":
        return RebuildViews(cache)
    if kind == "persistent":
        return PersistentViews(cache)
    raise ValueError(f"kv_views must be 'rebuild' or 'persistent', got {kind!r}")

"""Block bookkeeping for the paged KV cache: which blocks are free, which session owns which.

Pure Python on purpose (no torch): the books are kept on the host and unit-tested directly;
only ``kv_cache.py`` touches device memory. A token's place in the cache is its *slot*,
``block * block_size + offset``, the row index into the flattened cache tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfBlocks(Exception):
    """Not enough free blocks for the request; the books are left exactly as they were."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"need {needed} KV blocks, only {free} free")
        self.needed = needed
        self.free = free


class BlockAllocator:
    """A pool of ``num_blocks`` interchangeable blocks, handed out and taken back by id."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        # FIFO reuse spreads writes over the pool; any order would be correct.
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        # Check everything before changing anything, so a bad call cannot half-free a list.
        if len(set(blocks)) != len(blocks) or not self._used.issuperset(blocks):
            raise ValueError(f"freeing blocks that are not allocated (or twice): {blocks}")
        self._used.difference_update(blocks)
        self._free.extend(blocks)


class KVBookkeeper:
    """Per-session block tables on top of a ``BlockAllocator``.

    A session holds ``num_tokens`` tokens in ``ceil(num_tokens / block_size)`` blocks; the
    last block may be partly filled and is filled before a new one is taken.
    """

    def __init__(self, block_size: int, allocator: BlockAllocator) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.allocator = allocator
        self._blocks: dict[str, list[int]] = {}
        self._tokens: dict[str, int] = {}

    def has(self, session_id: str) -> bool:
        return session_id in self._tokens

    def num_tokens(self, session_id: str) -> int:
        """Tokens held for the session; 0 for a session that is not held."""
        return self._tokens.get(session_id, 0)

    def blocks(self, session_id: str) -> list[int]:
        return list(self._blocks.get(session_id, ()))

    def session_ids(self) -> list[str]:
        return list(self._tokens)

    def blocks_needed(self, session_id: str, n_tokens: int) -> int:
        """New blocks an append of ``n_tokens`` would take."""
        held_blocks = len(self._blocks.get(session_id, ()))
        total = self.num_tokens(session_id) + n_tokens
        return max(0, -(-total // self.block_size) - held_blocks)

    def can_append(self, session_id: str, n_tokens: int) -> bool:
        return self.allocator.can_allocate(self.blocks_needed(session_id, n_tokens))

    def append(self, session_id: str, n_tokens: int) -> list[int]:
        """Reserve room for ``n_tokens`` more tokens (creating the session if new).

        Returns their slots in order. Raises ``OutOfBlocks`` with nothing changed.
        """
        if n_tokens < 0:
            raise ValueError(f"cannot append {n_tokens} tokens")
        new_blocks = self.allocator.allocate(self.blocks_needed(session_id, n_tokens))
        table = self._blocks.setdefault(session_id, [])
        table.extend(new_blocks)
        start = self._tokens.get(session_id, 0)
        self._tokens[session_id] = start + n_tokens
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n_tokens)]

    def release(self, session_id: str) -> bool:
        """Give the session's blocks back; returns whether it was held (idempotent)."""
        if session_id not in self._tokens:
            return False
        self.allocator.free(self._blocks.pop(session_id))
        del self._tokens[session_id]
        return True

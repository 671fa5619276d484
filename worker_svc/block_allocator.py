"""Block bookkeeping for the paged KV cache: which blocks are free, which session owns which,
and which full blocks hold a prompt prefix another session may reuse (prefix caching).

Pure Python on purpose (no torch): the books are kept on the host and unit-tested directly;
only ``kv_cache.py`` touches device memory. A token's place in the cache is its *slot*,
``block * block_size + offset``, the row index into the flattened cache tensors.

Prefix caching: a *full* block is named by a hash chaining its parent block's hash and its own
token ids, so equal hashes mean equal token prefixes and hence equal K/V. Only full blocks are
shared: they are never written again, so sessions can read them at once. Blocks carry reference
counts; a block whose count drops to 0 but has a hash stays *cached* (evictable, least recently
released first) and counts as free: an allocation takes never-hashed blocks first and only then
evicts cached ones, so caching never costs capacity.

A session may carry a *cache salt* (the scheduler sends a hash of the caller's identity): it
seeds the session's hash chain, so blocks are shared only between sessions of the same salt, and
one tenant cannot learn from its time to first token whether another sent a given prompt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence


class OutOfBlocks(Exception):
    """Not enough free blocks for the request; the books are left exactly as they were."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"need {needed} KV blocks, only {free} free")
        self.needed = needed
        self.free = free


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The name of a full block: its tokens and, through ``parent``, every token before them.

    blake2b rather than ``hash()``: stable across processes and collision-resistant, since a
    collision would silently hand one prompt another prompt's K/V.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockAllocator:
    """A pool of ``num_blocks`` interchangeable blocks, handed out and taken back by id."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        # FIFO reuse spreads writes over the pool; any order would be correct.
        self._free: deque[int] = deque(range(num_blocks))  # free and holding no prefix
        self._cached: OrderedDict[int, bytes] = OrderedDict()  # free, hashed; least recent first
        self._refs: dict[int, int] = {}  # used block -> sessions holding it
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Free blocks still holding a reusable prefix."""
        return len(self._cached)

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free)
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:  # evict the least recently released prefix: its hash goes with it
                block, h = self._cached.popitem(last=False)
                del self._by_hash[h], self._hash_of[block]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody holds becomes free (cached if hashed)."""
        blocks = list(blocks)
        # Check everything before changing anything, so a bad call cannot half-free a list.
        if len(set(blocks)) != len(blocks) or not all(b in self._refs for b in blocks):
            raise ValueError(f"freeing blocks that are not allocated (or twice): {blocks}")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            del self._refs[b]
            if b in self._hash_of:
                self._cached[b] = self._hash_of[b]  # most recently released: evicted last
            else:
                self._free.append(b)

    def lookup(self, h: bytes) -> int | None:
        """The block holding the prefix named ``h``, used or cached; None if there is none."""
        return self._by_hash.get(h)

    def share(self, block: int) -> None:
        """Take a reference to a hashed block (in use by others, or cached: then it is no longer free)."""
        if block in self._cached:
            del self._cached[block]
            self._refs[block] = 1
        elif block in self._refs and block in self._hash_of:
            self._refs[block] += 1
        else:
            raise ValueError(f"block {block} holds no cached prefix")

    def register(self, block: int, h: bytes) -> bool:
        """Name a used, full block by its prefix hash; False (and no change) when another block
        already holds that prefix or this block is already named."""
        if block not in self._refs:
            raise ValueError(f"block {block} is not allocated")
        if h in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[h] = block
        self._hash_of[block] = h
        return True


class KVBookkeeper:
    """Per-session block tables on top of a ``BlockAllocator``.

    A session holds ``num_tokens`` tokens in ``ceil(num_tokens / block_size)`` blocks; the
    last block may be partly filled and is filled before a new one is taken.

    With ``prefix_caching`` the books also keep each session's chain of full-block hashes and
    the token ids of its partial last block. A block's hash reaches the allocator only through
    ``publish``, which the engine calls once the block's K/V are written: a block filled by a
    forward that then failed is never offered to another session.
    """

    def __init__(self, block_size: int, allocator: BlockAllocator, prefix_caching: bool = False) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.allocator = allocator
        self.prefix_caching = prefix_caching
        self._blocks: dict[str, list[int]] = {}
        self._tokens: dict[str, int] = {}
        self._chain: dict[str, list[bytes]] = {}  # hash of each full block, in order
        self._tail: dict[str, list[int]] = {}  # token ids past the last full block
        self._published: dict[str, int] = {}  # leading full blocks the allocator knows of
        self._salt: dict[str, bytes] = {}  # sessions with a cache salt: the root of their chain
        self.prefix_queries = 0  # tokens of prompt chunks looked up in the cache
        self.prefix_hits = 0  # of which were found there

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

    def append(self, session_id: str, n_tokens: int, token_ids: Sequence[int] | None = None) -> list[int]:
        """Reserve room for ``n_tokens`` more tokens (creating the session if new).

        Returns their slots in order. Raises ``OutOfBlocks`` with nothing changed. With prefix
        caching the token ids are required: the blocks they fill are named by them.
        """
        if n_tokens < 0:
            raise ValueError(f"cannot append {n_tokens} tokens")
        if self.prefix_caching and (token_ids is None or len(token_ids) != n_tokens):
            raise ValueError("prefix caching needs the token ids of every appended token")
        new_blocks = self.allocator.allocate(self.blocks_needed(session_id, n_tokens))
        table = self._blocks.setdefault(session_id, [])
        table.extend(new_blocks)
        start = self._tokens.get(session_id, 0)
        self._tokens[session_id] = start + n_tokens
        if self.prefix_caching:
            assert token_ids is not None
            self._extend_chain(session_id, token_ids)
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n_tokens)]

    def _extend_chain(self, session_id: str, token_ids: Sequence[int]) -> None:
        chain = self._chain.setdefault(session_id, [])
        tail = self._tail.setdefault(session_id, [])
        self._published.setdefault(session_id, 0)
        tail.extend(token_ids)
        bs = self.block_size
        while len(tail) >= bs:
            chain.append(block_hash(chain[-1] if chain else self._root(session_id), tail[:bs]))
            del tail[:bs]

    def _root(self, session_id: str) -> bytes | None:
        """The parent of the session's first block: its salt's namespace (None: unsalted)."""
        salt = self._salt.get(session_id)
        return None if salt is None else b"salt:" + salt

    def _match(self, session_id: str, token_ids: Sequence[int], max_blocks: int) -> list[tuple[int, bytes]]:
        """Cached blocks continuing the session's prefix with ``token_ids``: (block, hash) pairs."""
        if self._tail.get(session_id):
            return []  # a partial last block: the next tokens do not start a block
        chain = self._chain.get(session_id, [])
        parent = chain[-1] if chain else self._root(session_id)
        bs, found = self.block_size, []
        for i in range(max_blocks):
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self.allocator.lookup(h)
            if block is None:
                break
            found.append((block, h))
            parent = h
        return found

    def append_prefill(self, session_id: str, token_ids: Sequence[int], salt: bytes = b"") -> tuple[int, list[int]]:
        """Reserve a prompt chunk, first reusing cached full blocks that already hold its leading
        tokens; returns (reused tokens, slots of the tokens still to compute).

        At least one token is left to compute, so the chunk still yields logits. Without prefix
        caching nothing is reused. ``salt``: the cache namespace of a session this chunk creates
        (see the module docstring). Raises ``OutOfBlocks`` with nothing changed.
        """
        if not self.prefix_caching:
            return 0, self.append(session_id, len(token_ids), token_ids)
        new_salt = bool(salt) and session_id not in self._tokens
        if new_salt:
            self._salt[session_id] = salt
        try:
            return self._append_prefill(session_id, token_ids)
        except OutOfBlocks:
            if new_salt:  # nothing changed: not even the salt is kept
                del self._salt[session_id]
            raise

    def _append_prefill(self, session_id: str, token_ids: Sequence[int]) -> tuple[int, list[int]]:
        bs = self.block_size
        looked_up = self.num_tokens(session_id) % bs == 0
        found = self._match(session_id, token_ids, (len(token_ids) - 1) // bs) if looked_up else []
        reused = len(found) * bs
        # Reusing a cached (free) block takes it from the free pool, as a new block would.
        needed = self.blocks_needed(session_id, len(token_ids)) - len(found)
        needed += sum(1 for b, _ in found if self.allocator.is_cached(b))
        if needed > self.allocator.num_free:
            raise OutOfBlocks(needed, self.allocator.num_free)
        table = self._blocks.setdefault(session_id, [])
        chain = self._chain.setdefault(session_id, [])
        self._tail.setdefault(session_id, [])
        self._published.setdefault(session_id, 0)
        for block, h in found:  # publish() later skips them: they are named already
            self.allocator.share(block)
            table.append(block)
            chain.append(h)
        self._tokens[session_id] = self._tokens.get(session_id, 0) + reused
        slots = self.append(session_id, len(token_ids) - reused, token_ids[reused:])
        if looked_up:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += reused
        return reused, slots

    def publish(self, session_id: str) -> None:
        """Offer the session's full blocks to other sessions (call once their K/V are written)."""
        if not self.prefix_caching or session_id not in self._tokens:
            return
        chain, table = self._chain[session_id], self._blocks[session_id]
        for i in range(self._published[session_id], len(chain)):
            # False when another block already holds this prefix (both were computed in one
            # step): this copy stays private and is freed plainly.
            self.allocator.register(table[i], chain[i])
        self._published[session_id] = len(chain)

    def release(self, session_id: str) -> bool:
        """Give the session's blocks back; returns whether it was held (idempotent)."""
        if session_id not in self._tokens:
            return False
        # Last block first: a prompt's tail is then evicted before the prefix others share.
        self.allocator.free(reversed(self._blocks.pop(session_id)))
        del self._tokens[session_id]
        for books in (self._chain, self._tail, self._published, self._salt):
            books.pop(session_id, None)
        return True

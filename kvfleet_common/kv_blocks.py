"""The block tables of a worker's paged KV cache, kept by the scheduler (as vLLM v1 and TGI v3
do): which blocks are free, which session holds which, and which full blocks hold a token prefix
another session may reuse (prefix caching). The worker owns the memory and writes the slots it is
told; a token's place there is its *slot*, ``block * block_size + offset``.

Pure Python (no torch, no network): the scheduler core keeps one ``BlockTables`` per worker, and
in-process drivers of an engine (benchmarks, tests) use the same class.

Prefix caching: a *full* block is named by a hash chaining its parent block's hash and its own
token ids, so equal hashes mean equal token prefixes and hence equal K/V. Only full blocks are
shared: they are never written again, so sessions can read them at once. Blocks carry reference
counts; a block whose count drops to 0 but has a hash stays *cached* (evictable, least recently
released first) and counts as free: an allocation takes never-hashed blocks first and only then
evicts cached ones, so caching never costs capacity.

A session may carry a *cache salt* (the scheduler uses the caller's identity): it
seeds the session's hash chain, so blocks are shared only between sessions of the same salt, and
one tenant cannot learn from its time to first token whether another sent a given prompt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field


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

    def copy(self) -> BlockAllocator:
        """An independent copy (the scheduler plans a tick on copies of its books)."""
        new = BlockAllocator.__new__(BlockAllocator)
        new.num_blocks = self.num_blocks
        new._free = deque(self._free)
        new._cached = OrderedDict(self._cached)
        new._refs = dict(self._refs)
        new._by_hash = dict(self._by_hash)
        new._hash_of = dict(self._hash_of)
        return new

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


# Token ids [start, end) of a session's sequence (prompt, then generated): a slice on demand, so
# that a decode does not copy a long context to name the one block it filled.
TokenRange = Callable[[int, int], Sequence[int]]


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)
    root: bytes | None = None  # parent hash of the first block: the salt's namespace (None: shared)
    chain: list[bytes] = field(default_factory=list)  # hash of each written full block, in order
    sent: int = 0  # leading blocks the worker has been told of (see ``unsent``)


class BlockTables:
    """One worker's KV books: a ``BlockAllocator`` and, per session, its block table and the
    hash chain of its written full blocks.

    A session is *placed* with room for some number of tokens (its blocks are allocated then:
    what the scheduler reserves is what it holds), *grows* block by block, and says which of its
    tokens are *written* once a step that wrote them came back: only then are its full blocks
    named and offered to other sessions, so a block filled by a step that failed never is.
    Shared blocks count once: the used blocks of the allocator are the worker's reserved KV.

    ``copy()`` is cheap, for planning on: the copy shares the allocator and every table with the
    original until either side writes one (copy on write), since a tick touches few of them.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.prefix_caching = prefix_caching
        self._tables: dict[str, _Table] = {}
        # What this instance may write in place; the rest is shared with a copy (or its original).
        self._own_allocator = True
        self._owned: set[str] = set()
        self.prefix_queries = 0  # prompt tokens looked up at placement
        self.prefix_hits = 0  # of which were found cached (their KV reused, not computed)

    def copy(self) -> BlockTables:
        """Books equal to these, changed independently from now on (copy on write)."""
        new = BlockTables.__new__(BlockTables)
        new.block_size, new.prefix_caching = self.block_size, self.prefix_caching
        new.allocator, new._tables = self.allocator, dict(self._tables)
        new.prefix_queries, new.prefix_hits = self.prefix_queries, self.prefix_hits
        # Everything is shared now: whichever side writes first copies what it writes.
        new._own_allocator = self._own_allocator = False
        new._owned, self._owned = set(), set()
        return new

    def claim(self) -> None:
        """The books this copy was made from are dropped (a plan's draft became the state): it
        alone holds what they shared, so it writes in place from now on instead of copying the
        allocator (O(num_blocks)) at its next write, a result's full block or a finish."""
        self._own_allocator = True
        self._owned = set(self._tables)

    def _writable_allocator(self) -> BlockAllocator:
        if not self._own_allocator:
            self.allocator = self.allocator.copy()
            self._own_allocator = True
        return self.allocator

    def _writable(self, session_id: str) -> _Table:
        table = self._tables[session_id]
        if session_id not in self._owned:
            table = _Table(list(table.blocks), table.root, list(table.chain), table.sent)
            self._tables[session_id] = table
            self._owned.add(session_id)
        return table

    # ---- reads -------------------------------------------------------------------------------

    def has(self, session_id: str) -> bool:
        return session_id in self._tables

    def blocks(self, session_id: str) -> list[int]:
        t = self._tables.get(session_id)
        return list(t.blocks) if t is not None else []

    def session_ids(self) -> list[str]:
        return list(self._tables)

    def room(self, session_id: str) -> int:
        """Tokens the session's blocks can hold."""
        return len(self._tables[session_id].blocks) * self.block_size

    @staticmethod
    def _root(salt: bytes) -> bytes | None:
        return b"salt:" + salt if salt else None

    def _match(self, token_ids: Sequence[int], salt: bytes) -> list[tuple[int, bytes]]:
        """Published blocks holding the leading full blocks of ``token_ids``, leaving at least
        one token to compute (the prompt's last token must run for its logits)."""
        if not self.prefix_caching:
            return []
        bs, found = self.block_size, []
        parent = self._root(salt)
        for i in range((len(token_ids) - 1) // bs):
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self.allocator.lookup(h)
            if block is None:
                break
            found.append((block, h))
            parent = h
        return found

    def cached_prefix(self, token_ids: Sequence[int], salt: bytes = b"") -> int:
        """Leading tokens of a prompt whose KV this worker already holds (whole blocks)."""
        return len(self._match(token_ids, salt)) * self.block_size

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _cost(self, found: list[tuple[int, bytes]], tokens: int) -> int:
        new = max(self._blocks_for(tokens) - len(found), 0)
        return new + sum(1 for b, _ in found if self.allocator.is_cached(b))

    def _match_within(self, token_ids: Sequence[int], tokens: int, salt: bytes) -> list[tuple[int, bytes]]:
        return self._match(token_ids, salt)[: tokens // self.block_size]  # no more than it has room for

    def placement_cost(self, token_ids: Sequence[int], tokens: int, salt: bytes = b"") -> tuple[int, int]:
        """(cached tokens, blocks taken from the free pool) of placing a session that starts
        with ``token_ids`` and needs room for ``tokens``: the new blocks, plus the cached blocks
        it would reuse that nobody holds now (those leave the free pool too)."""
        found = self._match_within(token_ids, tokens, salt)
        return len(found) * self.block_size, self._cost(found, tokens)

    # ---- changes -----------------------------------------------------------------------------

    def place(self, session_id: str, token_ids: Sequence[int], tokens: int, salt: bytes = b"") -> int:
        """Give a new session blocks for ``tokens`` tokens, reusing the cached blocks that hold
        the leading tokens of ``token_ids``; returns how many tokens were found cached. Raises
        ``OutOfBlocks`` with nothing changed."""
        if session_id in self._tables:
            raise ValueError(f"session {session_id} is already placed")
        found = self._match_within(token_ids, tokens, salt)
        cached, taken = len(found) * self.block_size, self._cost(found, tokens)
        if taken > self.allocator.num_free:
            raise OutOfBlocks(taken, self.allocator.num_free)
        allocator = self._writable_allocator()
        table = _Table(root=self._root(salt))
        for block, h in found:
            allocator.share(block)
            table.blocks.append(block)
            table.chain.append(h)
        table.blocks += allocator.allocate(max(self._blocks_for(tokens) - len(found), 0))
        self._tables[session_id] = table
        self._owned.add(session_id)
        if self.prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += cached
        return cached

    def blocks_to_grow(self, session_id: str, tokens: int) -> int:
        return max(self._blocks_for(tokens) - len(self._tables[session_id].blocks), 0)

    def grow(self, session_id: str, tokens: int) -> None:
        """Make the session's blocks hold ``tokens``; ``OutOfBlocks`` with nothing changed."""
        need = self.blocks_to_grow(session_id, tokens)
        if need == 0:
            return
        if need > self.allocator.num_free:
            raise OutOfBlocks(need, self.allocator.num_free)
        self._writable(session_id).blocks += self._writable_allocator().allocate(need)

    def unsent(self, session_id: str) -> tuple[int, ...]:
        """The session's blocks the worker has not been told of yet; told of from now on."""
        table = self._tables[session_id]
        if table.sent == len(table.blocks):
            return ()  # (no write: a decode's table usually stays shared)
        table = self._writable(session_id)
        new = tuple(table.blocks[table.sent :])
        table.sent = len(table.blocks)
        return new

    def not_taken(self, session_id: str, blocks: int) -> None:
        """The worker did not take the last ``blocks`` blocks it was sent (its step refused the
        item): ``unsent`` names them again."""
        table = self._writable(session_id)
        table.sent = max(table.sent - blocks, 0)

    def written(self, session_id: str, upto: int, tokens: TokenRange) -> None:
        """The session's first ``upto`` tokens are in the worker's KV (a step that wrote them came
        back): name its full blocks among them and offer them to other sessions."""
        if not self.prefix_caching:
            return
        table, bs = self._tables[session_id], self.block_size
        full = min(upto // bs, len(table.blocks))
        if len(table.chain) >= full:
            return  # no new full block (no write)
        table = self._writable(session_id)
        for i in range(len(table.chain), full):
            parent = table.chain[-1] if table.chain else table.root
            h = block_hash(parent, tokens(i * bs, (i + 1) * bs))
            # False when another block already holds this prefix (both were computed in one
            # step): this copy stays private and is freed plainly.
            self._writable_allocator().register(table.blocks[i], h)
            table.chain.append(h)

    def free(self, session_id: str) -> bool:
        """Give the session's blocks back; returns whether it was placed (idempotent)."""
        table = self._tables.pop(session_id, None)
        if table is None:
            return False
        self._owned.discard(session_id)
        # Last block first: a prompt's tail is then evicted before the prefix others share.
        self._writable_allocator().free(reversed(table.blocks))
        return True

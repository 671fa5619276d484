"""Block allocator and per-session KV books: table-driven, with the free + used == total invariant."""

from __future__ import annotations

import pytest

from worker_svc.block_allocator import BlockAllocator, KVBookkeeper, OutOfBlocks


def _check_invariants(alloc: BlockAllocator, books: KVBookkeeper | None = None) -> None:
    assert alloc.num_free + alloc.num_used == alloc.num_blocks
    if books is None:
        return
    owned = [b for sid in books.session_ids() for b in books.blocks(sid)]
    assert len(owned) == len(set(owned)) == alloc.num_used, "a block owned twice or leaked"
    for sid in books.session_ids():
        assert len(books.blocks(sid)) == -(-books.num_tokens(sid) // books.block_size)


# (operations, expected free count after each). ("alloc", n) | ("free", index of earlier alloc)
ALLOCATOR_CASES = [
    ("fill exactly", [("alloc", 8)], [0]),
    ("alloc free realloc", [("alloc", 3), ("alloc", 2), ("free", 0), ("alloc", 6)], [5, 3, 6, 0]),
    ("zero blocks", [("alloc", 0), ("alloc", 8), ("free", 1)], [8, 0, 8]),
    ("too many leaves state", [("alloc", 5), ("alloc", 4), ("alloc", 3)], [3, 3, 0]),
]


@pytest.mark.parametrize("name,ops,free_after", ALLOCATOR_CASES, ids=[c[0] for c in ALLOCATOR_CASES])
def test_allocator_sequences(name: str, ops: list[tuple[str, int]], free_after: list[int]) -> None:
    alloc = BlockAllocator(8)
    grants: list[list[int]] = []
    for (op, arg), want_free in zip(ops, free_after):
        if op == "alloc":
            if alloc.can_allocate(arg):
                grants.append(alloc.allocate(arg))
                assert len(grants[-1]) == arg
            else:
                before = alloc.num_free
                with pytest.raises(OutOfBlocks):
                    alloc.allocate(arg)
                assert alloc.num_free == before
                grants.append([])
        else:
            alloc.free(grants[arg])
        assert alloc.num_free == want_free
        _check_invariants(alloc)


def test_allocator_rejects_double_free_and_foreign_blocks() -> None:
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(2)
    alloc.free(blocks)
    with pytest.raises(ValueError):
        alloc.free(blocks)
    held = alloc.allocate(1)
    with pytest.raises(ValueError):
        alloc.free([held[0], 99])  # nothing freed if any block is bad
    assert alloc.num_used == 1
    _check_invariants(alloc)


def test_allocator_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(0)
    with pytest.raises(ValueError):
        BlockAllocator(2).allocate(-1)


# (appends as (session, n_tokens), block_size, expected tokens per session, expected used blocks)
APPEND_CASES = [
    ("within one block", [("a", 3)], 4, {"a": 3}, 1),
    ("exactly one block", [("a", 4)], 4, {"a": 4}, 1),
    ("across a boundary", [("a", 3), ("a", 2)], 4, {"a": 5}, 2),
    ("token by token", [("a", 1)] * 9, 4, {"a": 9}, 3),
    ("two sessions", [("a", 5), ("b", 1), ("a", 3), ("b", 4)], 4, {"a": 8, "b": 5}, 4),
    ("long prompt", [("a", 17)], 4, {"a": 17}, 5),
]


@pytest.mark.parametrize("name,appends,bs,tokens,used", APPEND_CASES, ids=[c[0] for c in APPEND_CASES])
def test_append_sequences(
    name: str, appends: list[tuple[str, int]], bs: int, tokens: dict[str, int], used: int
) -> None:
    alloc = BlockAllocator(16)
    books = KVBookkeeper(bs, alloc)
    all_slots: list[int] = []
    for sid, n in appends:
        before = books.num_tokens(sid)
        assert books.can_append(sid, n)
        slots = books.append(sid, n)
        assert len(slots) == n
        # Slots of the appended tokens are exactly the positions' places in the block table.
        table = books.blocks(sid)
        assert slots == [table[p // bs] * bs + p % bs for p in range(before, before + n)]
        all_slots.extend(slots)
        _check_invariants(alloc, books)
    assert {sid: books.num_tokens(sid) for sid in tokens} == tokens
    assert alloc.num_used == used
    assert len(all_slots) == len(set(all_slots)), "two tokens share a slot"


def test_out_of_blocks_leaves_books_unchanged() -> None:
    alloc = BlockAllocator(3)
    books = KVBookkeeper(4, alloc)
    books.append("a", 6)  # 2 blocks, 2 free slots in the second
    assert books.can_append("a", 2)  # fits in the partly filled block
    assert not books.can_append("a", 7)  # needs 2 more blocks, 1 free
    assert not books.can_append("b", 5)
    with pytest.raises(OutOfBlocks):
        books.append("a", 7)
    with pytest.raises(OutOfBlocks):
        books.append("b", 5)
    assert books.num_tokens("a") == 6 and len(books.blocks("a")) == 2
    assert not books.has("b") and alloc.num_free == 1
    _check_invariants(alloc, books)


def test_release_returns_blocks_and_is_idempotent() -> None:
    alloc = BlockAllocator(8)
    books = KVBookkeeper(4, alloc)
    books.append("a", 9)
    books.append("b", 2)
    assert alloc.num_used == 4
    assert books.release("a") is True
    assert books.release("a") is False
    assert not books.has("a") and books.num_tokens("a") == 0 and books.blocks("a") == []
    assert alloc.num_used == 1
    _check_invariants(alloc, books)
    books.append("c", 28)  # the released blocks are reusable
    assert alloc.num_free == 0
    _check_invariants(alloc, books)

"""Block allocator and per-worker block tables: table-driven, with the free + used == total
invariant, no block held twice except through prefix sharing, and OutOfBlocks changing nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvfleet_common.kv_blocks import BlockAllocator, BlockTables, OutOfBlocks


def _check_invariants(alloc: BlockAllocator, tables: BlockTables | None = None) -> None:
    assert alloc.num_free + alloc.num_used == alloc.num_blocks
    assert 0 <= alloc.num_cached <= alloc.num_free
    if tables is None:
        return
    assert tables.allocator is alloc
    holders: dict[int, list[tuple[str, int]]] = {}  # block -> (session, index in its table)
    for sid in tables.session_ids():
        table = tables.blocks(sid)
        assert len(table) == len(set(table)), f"{sid} holds a block twice"
        assert tables.room(sid) == len(table) * tables.block_size
        for i, b in enumerate(table):
            assert 0 <= b < alloc.num_blocks
            holders.setdefault(b, []).append((sid, i))
    assert len(holders) == alloc.num_used, "a block leaked, or a free block is held"
    for b, held in holders.items():
        assert alloc.refcount(b) == len(held), f"block {b}: count {alloc.refcount(b)}, holders {held}"
        assert not alloc.is_cached(b)
        # A block is held twice only through the prefix cache: it holds one prefix, so it sits at
        # the same place in every table holding it.
        assert len({i for _, i in held}) == 1, f"block {b} held at different positions: {held}"


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
    freed: set[int] = set()
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
            freed.add(arg)
        assert alloc.num_free == want_free
        _check_invariants(alloc)
        held = [b for i, g in enumerate(grants) if i not in freed for b in g]
        assert len(held) == len(set(held)) == alloc.num_used, "a block granted twice"


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
    with pytest.raises(ValueError):
        alloc.free([held[0], held[0]])  # the same block twice in one call: nothing freed either
    assert alloc.num_used == 1 and alloc.refcount(held[0]) == 1
    _check_invariants(alloc)


def test_allocator_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(0)
    with pytest.raises(ValueError):
        BlockAllocator(2).allocate(-1)
    with pytest.raises(ValueError):
        BlockTables(4, 0)


# -- block tables ------------------------------------------------------------------------------

BS = 4


def _prompt(sid: str, n: int) -> list[int]:
    """The token ids of a session's sequence: sessions named by one letter share them."""
    key = ord(sid[0])
    return [(key * 31 + 7 * i) % 1000 for i in range(n)]


def _slicer(seq: list[int]) -> Callable[[int, int], list[int]]:
    return lambda a, b: seq[a:b]


def _snapshot(tables: BlockTables) -> tuple:
    alloc = tables.allocator
    return (
        {sid: tables.blocks(sid) for sid in tables.session_ids()},
        alloc.num_free,
        alloc.num_used,
        alloc.num_cached,
        tables.prefix_queries,
        tables.prefix_hits,
    )


# Operations, in order:
#   ("place", sid, tokens, expected cached)  place(sid, _prompt(sid, tokens), tokens)
#   ("grow", sid, tokens)                    grow(sid, tokens)
#   ("written", sid, upto)                   written(sid, upto, _prompt(sid, ...)[a:b])
#   ("free", sid)                            free(sid) (must return True)
# an op whose name ends in "!" must raise OutOfBlocks and change nothing.
# Then: the room of each session held at the end, and the allocator's used and cached blocks.
TABLE_CASES = [
    ("within one block", 16, [("place", "a", 3, 0)], {"a": 4}, 1, 0),
    ("exactly one block", 16, [("place", "a", 4, 0)], {"a": 4}, 1, 0),
    ("empty placement", 16, [("place", "a", 0, 0), ("grow", "a", 1)], {"a": 4}, 1, 0),
    ("long prompt", 16, [("place", "a", 17, 0)], {"a": 20}, 5, 0),
    ("grow across a boundary", 16, [("place", "a", 3, 0), ("grow", "a", 5)], {"a": 8}, 2, 0),
    ("grow token by token", 16, [("place", "a", 1, 0)] + [("grow", "a", n) for n in range(2, 10)], {"a": 12}, 3, 0),
    ("grow never shrinks", 16, [("place", "a", 9, 0), ("grow", "a", 2)], {"a": 12}, 3, 0),
    (
        "two sessions",
        16,
        [("place", "a", 5, 0), ("place", "b", 1, 0), ("grow", "a", 8), ("grow", "b", 5)],
        {"a": 8, "b": 8},
        4,
        0,
    ),
    (
        "free and reuse the blocks",
        4,
        [("place", "a", 9, 0), ("place", "b", 2, 0), ("free", "a"), ("place", "c", 12, 0)],
        {"b": 4, "c": 12},
        4,
        0,
    ),
    ("place past the pool", 4, [("place", "a", 9, 0), ("place!", "b", 5)], {"a": 12}, 3, 0),
    ("grow past the pool", 4, [("place", "a", 9, 0), ("grow", "a", 16), ("grow!", "a", 17)], {"a": 16}, 4, 0),
    (
        "unwritten blocks are never shared",
        16,
        [("place", "a", 9, 0), ("place", "a2", 9, 0)],
        {"a": 12, "a2": 12},
        6,
        0,
    ),
    (
        "written blocks are shared",
        16,
        [("place", "a", 9, 0), ("written", "a", 9), ("place", "a2", 10, 8), ("place", "b", 9, 0)],
        {"a": 12, "a2": 12, "b": 12},
        3 + 1 + 3,
        0,
    ),
    (
        "a shared block is freed by its last holder, and stays cached",
        16,
        [("place", "a", 9, 0), ("written", "a", 9), ("place", "a2", 9, 8), ("free", "a"), ("free", "a2")],
        {},
        0,
        2,
    ),
    (
        "reusing cached blocks takes them from the pool",
        4,
        [("place", "a", 12, 0), ("written", "a", 12), ("free", "a"), ("place", "a2", 16, 12), ("place!", "b", 1)],
        {"a2": 16},
        4,
        0,
    ),
    (
        "cached blocks are evicted when the pool needs them",
        4,
        [("place", "a", 12, 0), ("written", "a", 12), ("free", "a"), ("place", "b", 16, 0), ("free", "b")],
        {},
        0,
        0,
    ),
]


@pytest.mark.parametrize("name,num_blocks,ops,rooms,used,cached", TABLE_CASES, ids=[c[0] for c in TABLE_CASES])
def test_table_sequences(
    name: str, num_blocks: int, ops: list[tuple], rooms: dict[str, int], used: int, cached: int
) -> None:
    tables = BlockTables(num_blocks, BS)
    alloc = tables.allocator
    for op in ops:
        kind, sid, *args = op
        before = _snapshot(tables)
        if kind.endswith("!"):
            n = args[0]
            with pytest.raises(OutOfBlocks) as err:
                if kind == "place!":
                    tables.place(sid, _prompt(sid, n), n)
                else:
                    tables.grow(sid, n)
            assert err.value.free == alloc.num_free < err.value.needed
            assert _snapshot(tables) == before, f"{op} changed the tables"
        elif kind == "place":
            n, want_cached = args
            cost = tables.placement_cost(_prompt(sid, n), n)
            assert tables.cached_prefix(_prompt(sid, n)) == cost[0] == want_cached
            assert tables.place(sid, _prompt(sid, n), n) == want_cached, op
            assert tables.room(sid) == -(-n // BS) * BS
            assert alloc.num_free == before[1] - cost[1], "placement_cost disagrees with place"
        elif kind == "grow":
            n = args[0]
            room = tables.room(sid)
            need = tables.blocks_to_grow(sid, n)
            tables.grow(sid, n)
            assert tables.room(sid) == max(room, -(-n // BS) * BS) == room + need * BS
            assert tables.blocks(sid)[: room // BS] == before[0][sid], "grow moved held blocks"
        elif kind == "written":
            tables.written(sid, args[0], _slicer(_prompt(sid, args[0])))
            assert _snapshot(tables)[:4] == before[:4], "written allocated or freed"
        else:
            assert tables.free(sid) is True
            assert not tables.has(sid)
        _check_invariants(alloc, tables)
    assert {sid: tables.room(sid) for sid in tables.session_ids()} == rooms
    assert alloc.num_used == used and alloc.num_cached == cached


def test_unsent_names_each_block_once_in_table_order() -> None:
    tables = BlockTables(16, BS)
    tables.place("a", _prompt("a", 9), 9)
    first = tables.unsent("a")
    assert list(first) == tables.blocks("a") and len(first) == 3
    assert tables.unsent("a") == ()  # told once
    tables.grow("a", 12)  # fits the blocks held: nothing new
    assert tables.unsent("a") == ()
    tables.grow("a", 13)
    assert tables.unsent("a") == (tables.blocks("a")[3],)
    # A session placed over shared blocks is told of them too: they are in its table.
    tables.written("a", 13, _slicer(_prompt("a", 13)))
    assert tables.place("a2", _prompt("a", 10), 10) == 8
    sent = tables.unsent("a2")
    assert list(sent) == tables.blocks("a2") and sent[:2] == first[:2] and len(sent) == 3
    # The shared blocks stay told to a (its own tail is not re-sent).
    assert tables.unsent("a") == ()


def test_out_of_blocks_leaves_tables_unchanged() -> None:
    tables = BlockTables(3, BS)
    tables.place("a", _prompt("a", 6), 6)  # 2 blocks, 2 free slots in the second
    sent = tables.unsent("a")
    assert tables.blocks_to_grow("a", 8) == 0  # fits in the partly filled block
    assert tables.blocks_to_grow("a", 13) == 2  # needs 2 more blocks, 1 free
    before = _snapshot(tables)
    with pytest.raises(OutOfBlocks) as err:
        tables.grow("a", 13)
    assert (err.value.needed, err.value.free) == (2, 1)
    with pytest.raises(OutOfBlocks):
        tables.place("b", _prompt("b", 5), 5)
    assert _snapshot(tables) == before
    assert not tables.has("b") and tables.blocks("b") == []
    assert tables.unsent("a") == ()  # a failed grow leaves nothing to tell
    assert tables.prefix_queries == 6  # the failed placement looked nothing up for the counters
    # What does fit still goes: the one free block.
    tables.grow("a", 12)
    assert tables.unsent("a") == (tables.blocks("a")[2],) and sent == tuple(tables.blocks("a")[:2])
    assert tables.allocator.num_free == 0
    _check_invariants(tables.allocator, tables)


def test_placing_a_session_twice_is_refused_and_changes_nothing() -> None:
    tables = BlockTables(8, BS)
    tables.place("a", _prompt("a", 5), 5)
    before = _snapshot(tables)
    with pytest.raises(ValueError):
        tables.place("a", _prompt("a", 5), 5)
    assert _snapshot(tables) == before


def test_free_returns_blocks_and_is_idempotent() -> None:
    tables = BlockTables(8, BS)
    alloc = tables.allocator
    tables.place("a", _prompt("a", 9), 9)
    tables.place("b", _prompt("b", 2), 2)
    assert alloc.num_used == 4
    assert tables.free("a") is True
    assert tables.free("a") is False
    assert tables.free("never") is False
    assert not tables.has("a") and tables.blocks("a") == [] and tables.session_ids() == ["b"]
    assert alloc.num_used == 1
    _check_invariants(alloc, tables)
    tables.place("c", _prompt("c", 28), 28)  # the freed blocks are placed again
    assert alloc.num_free == 0
    _check_invariants(alloc, tables)
    # A freed session may be placed anew (a recompute), with fresh blocks to tell.
    tables.free("b")
    tables.place("b", _prompt("b", 3), 3)
    assert len(tables.unsent("b")) == 1
    _check_invariants(alloc, tables)

"""Prefix caching: the allocator's reference counts and LRU of cached blocks, the block tables'
hash chains (kept by the scheduler, here as by an in-process driver), and the engine's reuse of
shared prompt prefixes through ``LocalSteps``, token-exact with caching off in both KV view modes
(tiny model here; one SmolLM2 case with a 200-token system prompt)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pytest

from kvfleet_common.kv_blocks import BlockAllocator, BlockTables, OutOfBlocks, block_hash
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_logits
from kvfleet_models.tiny import tiny_weights
from worker_svc.engine import DecodeItem, Engine, EngineConfig, ItemStatus, PrefillItem, SamplingSpec
from worker_svc.kv_views_mode import KVViewsMode
from worker_svc.local import LocalSteps

GREEDY = SamplingSpec()
TINY = tiny_config()
TINY_WEIGHTS = tiny_weights(TINY, seed=0)
BS = 4


def _tokens(n: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt + 3) % TINY.vocab_size for i in range(n)]


def _check_tables(tables: BlockTables) -> None:
    """Nothing leaks: free + used == total, each used block's count is its holders, and a block
    held twice is a shared prefix block (at the same place in every table holding it)."""
    alloc = tables.allocator
    assert alloc.num_free + alloc.num_used == alloc.num_blocks
    held: dict[int, set[int]] = {}  # block -> its indexes in the tables holding it
    counts: dict[int, int] = {}
    for sid in tables.session_ids():
        table = tables.blocks(sid)
        assert len(table) == len(set(table))
        for i, b in enumerate(table):
            held.setdefault(b, set()).add(i)
            counts[b] = counts.get(b, 0) + 1
    assert len(held) == alloc.num_used
    assert all(alloc.refcount(b) == n for b, n in counts.items())
    assert all(len(at) == 1 for at in held.values())


def _written(tables: BlockTables, sid: str, seq: Sequence[int], upto: int | None = None) -> None:
    tables.written(sid, len(seq) if upto is None else upto, lambda a, b: seq[a:b])


# -- allocator --------------------------------------------------------------------------------


def test_shared_block_is_freed_only_when_every_holder_releases() -> None:
    alloc = BlockAllocator(4)
    (b,) = alloc.allocate(1)
    h = block_hash(None, [1, 2, 3, 4])
    assert alloc.register(b, h)
    alloc.share(b)
    assert alloc.refcount(b) == 2
    alloc.free([b])
    assert alloc.refcount(b) == 1 and alloc.num_used == 1 and alloc.num_cached == 0
    alloc.free([b])
    assert alloc.num_used == 0 and alloc.num_free == 4 and alloc.num_cached == 1
    assert alloc.lookup(h) == b  # still reusable while free
    alloc.share(b)  # found again: in use, no longer free
    assert alloc.refcount(b) == 1 and alloc.num_free == 3 and alloc.num_cached == 0


def test_register_refuses_a_second_block_for_one_prefix_and_unallocated_blocks() -> None:
    alloc = BlockAllocator(4)
    a, b = alloc.allocate(2)
    h = block_hash(None, [5] * 4)
    assert alloc.register(a, h)
    assert not alloc.register(b, h)  # another block already holds this prefix
    assert alloc.lookup(h) == a
    alloc.free([b])
    assert alloc.num_cached == 0  # b was never named: it is plainly free
    with pytest.raises(ValueError):
        alloc.register(b, block_hash(None, [6] * 4))
    with pytest.raises(ValueError):
        alloc.share(b)


def test_allocation_takes_unnamed_blocks_first_then_evicts_least_recently_released() -> None:
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(4)
    hashes = [block_hash(None, [i] * 4) for i in range(3)]
    for b, h in zip(blocks, hashes):
        alloc.register(b, h)
    # Release order: 1, 0, 2 named, then 3 unnamed.
    for b in (blocks[1], blocks[0], blocks[2], blocks[3]):
        alloc.free([b])
    assert alloc.num_free == 4 and alloc.num_cached == 3
    assert alloc.allocate(1) == [blocks[3]]  # the unnamed one first: no prefix lost
    assert alloc.num_cached == 3
    assert alloc.allocate(1) == [blocks[1]]  # then the least recently released named one
    assert alloc.lookup(hashes[1]) is None  # evicted with its hash
    assert alloc.lookup(hashes[0]) == blocks[0] and alloc.lookup(hashes[2]) == blocks[2]
    assert alloc.allocate(2) == [blocks[0], blocks[2]]
    assert alloc.num_cached == 0 and alloc.num_free == 0
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)


# -- block tables -----------------------------------------------------------------------------


def test_hash_chain_names_the_whole_prefix() -> None:
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert block_hash(None, a) == block_hash(None, list(a))  # stable, content-derived
    # the same block after a different parent is a different prefix
    assert block_hash(block_hash(None, a), b) != block_hash(block_hash(None, b), b)
    assert block_hash(None, [1, 2, 3, 4]) != block_hash(None, [1, 2, 3, 5])


def test_tables_reuse_written_full_blocks_and_leave_one_token_to_compute() -> None:
    tables = BlockTables(16, BS)
    prompt = _tokens(10, 1)  # two full blocks and a partial one
    assert tables.place("a", prompt, 10) == 0
    # Before the step that writes them came back nothing is offered.
    assert tables.cached_prefix(prompt) == 0
    assert tables.place("b", prompt, 10) == 0
    tables.free("b")
    # Written up to 7 tokens: only the first block is full.
    _written(tables, "a", prompt, 7)
    assert tables.cached_prefix(prompt) == 4
    _written(tables, "a", prompt)
    assert tables.place("c", prompt[:9] + [0, 1, 2], 12) == 8
    assert tables.blocks("c")[:2] == tables.blocks("a")[:2]
    assert tables.blocks("c")[2] != tables.blocks("a")[2]  # a's partial block is its own
    # A prompt of exactly two blocks reuses one: its last token must still run for logits.
    assert tables.cached_prefix(prompt[:8]) == 4
    assert tables.place("d", prompt[:8], 8) == 4
    # A prompt that differs inside the first block reuses nothing.
    assert tables.place("e", [prompt[0] + 1] + prompt[1:], 10) == 0
    assert tables.prefix_queries == 10 + 10 + 12 + 8 + 10 and tables.prefix_hits == 8 + 4
    _check_tables(tables)
    for sid in ("a", "c", "d", "e"):
        tables.free(sid)
        _check_tables(tables)
    assert tables.allocator.num_used == 0 and tables.allocator.num_cached == 2  # a's full blocks


def test_placement_cost_counts_cached_blocks_it_takes_from_the_pool() -> None:
    tables = BlockTables(8, BS)
    prompt = _tokens(9, 2)
    tables.place("a", prompt, 9)  # 3 blocks
    _written(tables, "a", prompt)
    # While a holds them, reusing its two full blocks takes only the new block from the pool.
    assert tables.placement_cost(prompt, 12) == (8, 1)
    assert tables.placement_cost(prompt, 20) == (8, 3)
    tables.free("a")
    # Once freed they are cached (free): reusing them takes them from the pool as well.
    assert tables.placement_cost(prompt, 12) == (8, 3)
    assert tables.placement_cost(_tokens(9, 3), 12) == (0, 3)
    free = tables.allocator.num_free
    assert tables.place("b", prompt, 12) == 8
    assert tables.allocator.num_free == free - 3


def test_decode_tokens_fill_blocks_that_later_prompts_reuse() -> None:
    tables = BlockTables(16, BS)
    prompt = _tokens(6, 2)
    tables.place("a", prompt, 6)
    seq = list(prompt)
    _written(tables, "a", seq)
    for t in (9, 8, 7):  # decodes, one block-growth at a time, each written once it ran
        tables.grow("a", len(seq) + 1)
        seq.append(t)
        _written(tables, "a", seq)
    assert tables.room("a") == 12
    tables.free("a")
    # Both blocks, the second filled by decode tokens; the partial third is not.
    assert tables.place("b", seq + [1], 10) == 8
    assert tables.cached_prefix(seq + [1, 2, 3, 4]) == 8


def test_a_cache_salt_shares_blocks_only_within_its_namespace() -> None:
    tables = BlockTables(32, BS)
    prompt = _tokens(9, 5)  # two full blocks
    tables.place("a", prompt, 9, salt=b"tenant-a")
    _written(tables, "a", prompt)
    assert tables.cached_prefix(prompt, b"tenant-a") == 8
    assert tables.place("b", prompt, 9, salt=b"tenant-b") == 0  # another tenant: computed
    assert tables.place("plain", prompt, 9) == 0  # the unsalted namespace is apart too
    assert tables.place("a2", prompt, 9, salt=b"tenant-a") == 8  # the same tenant reuses
    # ... and so do unsalted sessions among themselves, apart from every tenant.
    _written(tables, "plain", prompt)
    assert tables.cached_prefix(prompt) == 8
    assert tables.place("plain2", prompt, 9) == 8
    assert not set(tables.blocks("plain2")[:2]) & set(tables.blocks("a")[:2])
    # Decode tokens extend a salted chain in its namespace: a later prompt of the same tenant
    # reuses the block they filled, another tenant's does not.
    other = _tokens(5, 6)
    tables.place("d", other[:3], 3, salt=b"tenant-a")
    tables.grow("d", 4)
    _written(tables, "d", other[:4])
    tables.free("d")
    assert tables.place("d2", other, 5, salt=b"tenant-a") == 4
    assert tables.place("d3", other, 5, salt=b"tenant-c") == 0
    assert tables.place("d4", other, 5) == 0
    for sid in tables.session_ids():
        tables.free(sid)
    _check_tables(tables)
    # A salted placement that does not fit changes nothing.
    small = BlockTables(1, BS)
    with pytest.raises(OutOfBlocks):
        small.place("x", prompt, 9, salt=b"tenant-a")
    assert not small.has("x") and small.allocator.num_free == 1 and small.prefix_queries == 0
    assert small.place("x", prompt[:3], 3, salt=b"tenant-a") == 0  # placed afresh once it fits


def test_out_of_blocks_with_a_reused_prefix_leaves_the_tables_unchanged() -> None:
    tables = BlockTables(4, BS)
    prompt = _tokens(9, 3)
    tables.place("a", prompt, 9)  # 3 blocks
    _written(tables, "a", prompt)
    tables.free("a")
    assert tables.allocator.num_cached == 2
    # Reusing 2 cached blocks takes them from the free pool too: 2 + 3 new > 4.
    longer = prompt[:8] + _tokens(9, 4)
    assert tables.placement_cost(longer, 17) == (8, 5)
    with pytest.raises(OutOfBlocks) as err:
        tables.place("b", longer, 17)
    assert (err.value.needed, err.value.free) == (5, 4)
    assert not tables.has("b") and tables.allocator.num_cached == 2 and tables.allocator.num_used == 0
    assert tables.prefix_queries == 9 and tables.prefix_hits == 0
    _check_tables(tables)
    # The cached prefix is still there, whole: a placement that fits reuses it.
    assert tables.cached_prefix(longer) == 8
    assert tables.place("c", longer, 16) == 8
    _check_tables(tables)


def test_tables_without_prefix_caching_never_name_blocks() -> None:
    tables = BlockTables(8, BS, prefix_caching=False)
    prompt = _tokens(9, 1)
    tables.place("a", prompt, 9)
    _written(tables, "a", prompt)
    assert tables.allocator.lookup(block_hash(None, prompt[:4])) is None
    assert tables.cached_prefix(prompt) == 0
    tables.free("a")
    assert tables.place("b", prompt, 9) == 0
    assert tables.allocator.num_cached == 0 and tables.prefix_queries == tables.prefix_hits == 0
    # The same steps with it on do name them (so the assertions above can fail).
    on = BlockTables(8, BS)
    on.place("a", prompt, 9)
    _written(on, "a", prompt)
    assert on.allocator.lookup(block_hash(None, prompt[:4])) == on.blocks("a")[0]


def test_eviction_takes_a_prompt_s_tail_first_and_least_recently_released_first() -> None:
    tables = BlockTables(4, BS)
    p = _tokens(16, 7)
    tables.place("a", p, 16)
    a_blocks = tables.blocks("a")
    _written(tables, "a", p)
    tables.free("a")  # last block first: the tail is the least recently released
    assert tables.allocator.num_cached == 4 and tables.cached_prefix(p + [0]) == 16
    tables.place("x", _tokens(4, 8), 4)
    assert tables.blocks("x") == [a_blocks[3]]
    assert tables.cached_prefix(p + [0]) == 12  # the tail went, the prefix stays
    tables.place("y", _tokens(4, 9), 4)
    assert tables.blocks("y") == [a_blocks[2]] and tables.cached_prefix(p + [0]) == 8
    for sid in ("x", "y"):
        tables.free(sid)
    _check_tables(tables)

    # Reuse refreshes a block: released before another prompt's, but reused since, it is
    # evicted after that prompt's blocks.
    tables = BlockTables(4, BS)
    pa, pb = _tokens(8, 10), _tokens(8, 11)
    for sid, p in (("a", pa), ("b", pb)):
        tables.place(sid, p, 8)
        _written(tables, sid, p)
    tables.free("a")
    tables.free("b")  # least recent first: a's tail, a's head, b's tail, b's head
    assert tables.place("a2", pa[:5], 5) == 4  # takes a's head back, and a's tail for its own
    tables.free("a2")  # a's head is now the most recently released
    assert tables.cached_prefix(pa + [0]) == 4 and tables.cached_prefix(pb + [0]) == 8
    tables.place("c", _tokens(8, 12), 8)  # a2's unnamed block first, then b's tail
    assert tables.cached_prefix(pa + [0]) == 4 and tables.cached_prefix(pb + [0]) == 4
    tables.place("d", _tokens(4, 13), 4)  # then b's head, not a's older-released head
    assert tables.cached_prefix(pa + [0]) == 4 and tables.cached_prefix(pb + [0]) == 0
    assert tables.allocator.num_cached == 1
    _check_tables(tables)


# -- engine, driven through LocalSteps --------------------------------------------------------


def _steps(prefix_caching: bool, kv_views: str = "rebuild", num_blocks: int = 64, block_size: int = BS) -> LocalSteps:
    engine = Engine(
        TINY,
        TINY_WEIGHTS,
        EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            kv_views=KVViewsMode.parse(kv_views),
            prefix_caching=prefix_caching,
        ),
    )
    return LocalSteps(engine)


def _check(steps: LocalSteps) -> None:
    """The tables' books and the engine agree: the same sessions, the same blocks in use."""
    _check_tables(steps.tables)
    assert sorted(steps.engine.session_ids()) == sorted(steps.tables.session_ids())
    assert steps.engine.stats().used_blocks == steps.tables.allocator.num_used


def _generate(
    steps: LocalSteps, sid: str, prompt: Sequence[int], new: int, chunk: int = 0
) -> tuple[list[int], int, np.ndarray]:
    """Greedy: (generated tokens, cached tokens over all chunks, the first token's logits)."""
    chunk = chunk or len(prompt)
    cached, pos = 0, 0
    while True:
        part = tuple(prompt[pos : pos + chunk])
        last = pos + len(part) == len(prompt)
        out = steps.step([PrefillItem(sid, part, pos, last, GREEDY)], [], return_logits=last)
        (r,) = out.results
        assert r.status is ItemStatus.OK, r.error
        assert r.kv_tokens == pos + len(part)
        cached += r.cached_tokens
        pos += len(part)
        if last:
            break
    assert out.logits is not None and r.token_id is not None
    first_logits = out.logits[0]
    tokens = [r.token_id]
    for i in range(1, new):
        (r,) = steps.step([], [DecodeItem(sid, tokens[-1], len(prompt) + i - 1, GREEDY, i)]).results
        assert r.status is ItemStatus.OK and r.cached_tokens == 0 and r.token_id is not None, r.error
        tokens.append(r.token_id)
    _check(steps)
    return tokens, cached, first_logits


def _shared_prefix_prompts() -> list[list[int]]:
    prefix = _tokens(41, 5)
    return [
        prefix + _tokens(3, 6),
        prefix + _tokens(7, 7),
        prefix + _tokens(3, 6),  # a repeat of the first
        prefix[:17],  # shorter than the prefix
        _tokens(12, 9) + prefix,  # the prefix elsewhere: no hit
    ]


def _expected_cached(prompt: list[int], earlier: list[list[int]], bs: int = BS) -> int:
    common = 0
    for e in earlier:
        n = 0
        while n < min(len(e), len(prompt)) and e[n] == prompt[n]:
            n += 1
        common = max(common, n)
    return min(common // bs, (len(prompt) - 1) // bs) * bs


@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
def test_engine_reuses_shared_prefixes_token_exact(kv_views: str) -> None:
    on, off = _steps(True, kv_views), _steps(False, kv_views)
    prompts = _shared_prefix_prompts()
    for i, prompt in enumerate(prompts):
        got, cached, logits = _generate(on, f"s{i}", prompt, 6)
        want, none, _ = _generate(off, f"s{i}", prompt, 6)
        assert got == want, f"prompt {i}"
        assert none == 0
        assert cached == _expected_cached(prompt, prompts[:i]), f"prompt {i}"
        # The logits computed over reused K/V match the numpy reference on the whole prompt.
        np.testing.assert_allclose(logits, reference_logits(TINY, TINY_WEIGHTS, prompt)[-1], atol=1e-4, rtol=0)
        on.release([f"s{i}"])
        off.release([f"s{i}"])
        _check(on)
    s = on.engine.stats()
    assert s.prefix_cache_queries == on.tables.prefix_queries == sum(len(p) for p in prompts)
    want_hits = sum(_expected_cached(p, prompts[:i]) for i, p in enumerate(prompts))
    assert s.prefix_cache_hits == on.tables.prefix_hits == want_hits > 0
    assert s.prefill_tokens == off.engine.stats().prefill_tokens == sum(len(p) for p in prompts)
    assert s.used_blocks == 0 and s.free_blocks == 64 and on.tables.allocator.num_cached > 0
    assert off.engine.stats().prefix_cache_queries == off.tables.allocator.num_cached == 0


def test_engine_reuse_across_kv_view_modes_and_chunks() -> None:
    """A prefix computed under one view mode, reused by a chunked prefill under the other while
    its first holder is still running: the persistent row is filled from the shared blocks."""
    on, off = _steps(True), _steps(False)
    prefix = _tokens(33, 11)
    first = prefix + _tokens(5, 12)
    second = prefix + _tokens(9, 13)
    first_tok: dict[str, int] = {}
    for name, steps in (("on", on), ("off", off)):
        (r,) = steps.step([PrefillItem("a", tuple(first), 0, True, GREEDY)], [], kv_views="rebuild").results
        assert r.token_id is not None
        first_tok[name] = r.token_id
    cached, pos, tokens = 0, 0, dict[str, int]()
    # The first chunk places the session (LocalSteps looks up only there): 22 tokens reuse five
    # of its blocks, leaving two tokens to compute; later chunks start off a block boundary.
    for chunk in (22, 10, 10):
        part = tuple(second[pos : pos + chunk])
        last = pos + chunk == len(second)
        for name, steps in (("on", on), ("off", off)):
            (r,) = steps.step([PrefillItem("b", part, pos, last, GREEDY)], [], kv_views="persistent").results
            assert r.status is ItemStatus.OK and r.kv_tokens == pos + chunk
            if name == "on":
                cached += r.cached_tokens
            if last:
                assert r.token_id is not None
                tokens[name] = r.token_id
        pos += chunk
    assert cached == 20
    assert tokens["on"] == tokens["off"]
    # Both sessions decode on together over their shared blocks, still token-exact.
    held = {"a": len(first), "b": len(second)}
    for _ in range(3):
        got = {}
        for name, steps in (("on", on), ("off", off)):
            decode = [
                DecodeItem("a", first_tok[name], held["a"], GREEDY, 1),
                DecodeItem("b", tokens[name], held["b"], GREEDY, 1),
            ]
            results = steps.step([], decode, kv_views="persistent").results
            assert [r.kv_tokens for r in results] == [held["a"] + 1, held["b"] + 1]
            got[name] = [r.token_id or 0 for r in results]
        assert got["on"] == got["off"]
        first_tok = {n: g[0] for n, g in got.items()}
        tokens = {n: g[1] for n, g in got.items()}
        held = {sid: n + 1 for sid, n in held.items()}
    _check(on)
    _check(off)
    assert len(set(on.tables.blocks("a")) & set(on.tables.blocks("b"))) == 5  # 20 shared tokens
    assert not set(off.tables.blocks("a")) & set(off.tables.blocks("b"))


def test_sessions_with_one_prefix_in_one_step_compute_it_each_then_publish_one_copy() -> None:
    on, off = _steps(True), _steps(False)
    prefix = _tokens(20, 14)
    items = [PrefillItem(s, tuple(prefix + _tokens(2, k)), 0, True, GREEDY) for k, s in enumerate("ab")]
    both = on.step(items, []).results
    assert [r.cached_tokens for r in both] == [0, 0]  # neither's blocks were written yet
    assert [r.token_id for r in both] == [r.token_id for r in off.step(items, []).results]
    assert not set(on.tables.blocks("a")) & set(on.tables.blocks("b"))
    third = prefix + _tokens(2, 3)
    got, cached, _ = _generate(on, "c", third, 3)
    assert cached == 20 and got == _generate(off, "c", third, 3)[0]
    # One of the two computed copies was published (the first written: a's); the other stays
    # private and is plainly freed.
    assert on.tables.blocks("c")[:5] == on.tables.blocks("a")[:5]
    on.release(["a", "b"])
    assert on.tables.allocator.num_cached == 0  # c still holds the five published blocks
    on.release(["c"])
    _check(on)
    # a's five prefix blocks plus c's sixth (filled by its decode tokens): 22 + 2 tokens held
    assert on.tables.allocator.num_cached == 6


@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
def test_eviction_under_pressure_keeps_tokens_exact(kv_views: str) -> None:
    """A cache of 12 blocks: later sessions evict earlier prefixes (least recently released
    first) and a reused prefix that was evicted is recomputed, never read stale."""
    on, off = _steps(True, kv_views, num_blocks=12), _steps(False, kv_views, num_blocks=12)
    a, b = _tokens(24, 20), _tokens(24, 21)
    plan = [("a1", a + [1]), ("b1", b + [2]), ("a2", a + [3]), ("b2", b + [4]), ("c", _tokens(40, 22)), ("a3", a)]
    cached_seen = {}
    for sid, prompt in plan:
        got, cached, _ = _generate(on, sid, prompt, 4)
        assert got == _generate(off, sid, prompt, 4)[0], sid
        cached_seen[sid] = cached
        on.release([sid])
        off.release([sid])
        _check(on)
        assert on.tables.allocator.num_cached <= 12
    assert cached_seen["a1"] == cached_seen["b1"] == 0
    # Each 7-block session evicts two of the previous one's blocks: its tail (released first,
    # so least recent), never the leading blocks, so 5 of the 6 prefix blocks are still found.
    assert cached_seen["a2"] == cached_seen["b2"] == 20
    # c's 11 blocks leave only the most recently released block (b2's first): a is recomputed.
    assert cached_seen["a3"] == 0
    assert on.engine.stats().free_blocks == 12


def test_out_of_blocks_when_reuse_cannot_fit_raises_and_changes_nothing() -> None:
    steps, off = _steps(True, num_blocks=6), _steps(False, num_blocks=6)
    prompt = _tokens(16, 30)
    _generate(steps, "a", prompt + [1], 1)
    steps.release(["a"])
    assert steps.tables.allocator.num_cached == 4
    big = PrefillItem("big", tuple(_tokens(12, 31)), 0, True, GREEDY)
    (r,) = steps.step([big], []).results  # 3 blocks: the two unnamed ones, then a's tail
    assert r.status is ItemStatus.OK
    assert steps.tables.cached_prefix(prompt + [1]) == 12

    def books() -> tuple:
        t = steps.tables
        return (steps.engine.stats(), t.blocks("big"), t.allocator.num_free, t.allocator.num_cached,
                t.prefix_queries, t.prefix_hits)  # fmt: skip

    before = books()
    # Reusing the three cached blocks takes them from the pool too: 3 + 3 new > 3 free.
    longer = tuple(prompt + _tokens(5, 32))
    assert steps.tables.placement_cost(longer, len(longer)) == (12, 6)
    with pytest.raises(OutOfBlocks):
        steps.step([PrefillItem("b", longer, 0, True, GREEDY)], [])
    after = books()
    assert after == before  # the engine never ran (its step count too), the tables unchanged
    assert not steps.tables.has("b") and "b" not in steps.engine.session_ids()
    _check(steps)
    # Once there is room the same prompt reuses the prefix that was kept, token-exact.
    steps.release(["big"])
    got, cached, _ = _generate(steps, "b", longer, 2)
    assert cached == 12 and got == _generate(off, "b", longer, 2)[0]


def test_prefix_caching_off_is_the_plain_engine() -> None:
    steps = _steps(False)
    prompt = _tokens(20, 40)
    runs = []
    for sid in ("a", "b"):
        got, cached, _ = _generate(steps, sid, prompt, 2)
        assert cached == 0
        runs.append(got)
        steps.release([sid])
    assert runs[0] == runs[1]
    s = steps.engine.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits, steps.tables.allocator.num_cached) == (0, 0, 0)
    # LocalSteps may switch it off over an engine that allows it: then nothing is shared either.
    on = _steps(True)
    plain = LocalSteps(on.engine, prefix_caching=False)
    for sid in ("a", "b"):
        got, cached, _ = _generate(plain, sid, prompt, 2)
        assert cached == 0 and got == runs[0]
        plain.release([sid])
    assert plain.tables.allocator.num_cached == 0 and on.engine.stats().prefix_cache_hits == 0


def test_worker_flag_off_is_honoured_from_the_environment(monkeypatch) -> None:
    from worker_svc.__main__ import parse_args

    monkeypatch.setenv("KVFLEET_PREFIX_CACHING", "false")
    assert parse_args([]).prefix_caching is False
    assert parse_args(["--prefix-caching"]).prefix_caching is True
    monkeypatch.delenv("KVFLEET_PREFIX_CACHING")
    assert parse_args([]).prefix_caching is True
    assert parse_args(["--no-prefix-caching"]).prefix_caching is False


def test_worker_metrics_export_the_prefix_cache_counters() -> None:
    from prometheus_client import generate_latest

    from worker_svc.metrics import WorkerMetrics

    steps = _steps(True)
    prompt = _tokens(30, 50)
    for sid in ("a", "b"):
        _generate(steps, sid, prompt, 1)
        steps.release([sid])
    metrics = WorkerMetrics(steps.engine)
    metrics.refresh()
    text = generate_latest(metrics.registry).decode()
    s = steps.engine.stats()
    assert s.prefix_cache_hits == 28 and s.prefix_cache_queries == 60
    for name in ("hits", "queries"):  # the TYPE line names a counter with or without _total
        assert re.search(rf"^# TYPE kvfleet:worker_prefix_cache_{name}(_total)? counter$", text, re.M), name
    assert f"kvfleet:worker_prefix_cache_hits_total {float(s.prefix_cache_hits)}" in text
    assert f"kvfleet:worker_prefix_cache_queries_total {float(s.prefix_cache_queries)}" in text


# -- the real model ---------------------------------------------------------------------------


SYSTEM = (
    "You are a careful assistant for a small bookshop. You answer questions about opening hours, "
    "orders, deliveries and returns. Opening hours are Monday to Friday from nine to six and "
    "Saturday from ten to four; the shop is closed on Sundays and public holidays. Orders placed "
    "before noon ship the same day; deliveries take two to four working days within the country "
    "and up to ten days abroad. Books may be returned within thirty days in their original "
    "condition with the receipt; gift cards cannot be returned. Be brief, friendly and precise, "
    "and never invent a policy that is not written here. If you do not know, say so."
)
USER_TURNS = ["When do you open on Saturday?", "Can I return a gift card?", "How long does delivery abroad take?"]


@pytest.mark.slow
@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
def test_smollm2_shared_system_prompt_is_reused_token_exact(kv_views: str, smollm2_model, smollm2_tokenizer) -> None:
    (cfg, weights), tok = smollm2_model, smollm2_tokenizer
    prompts = [tok.encode(f"{SYSTEM}\nUser: {u}\nAssistant:") for u in USER_TURNS]
    system_len = len(tok.encode(SYSTEM))
    assert system_len >= 100
    drivers = {
        on: LocalSteps(
            Engine(cfg, weights, EngineConfig(num_blocks=128, kv_views=KVViewsMode.parse(kv_views), prefix_caching=on))
        )
        for on in (True, False)
    }
    for i, prompt in enumerate(prompts):
        runs = {}
        for on, steps in drivers.items():
            (r,) = steps.step([PrefillItem(f"s{i}", tuple(prompt), 0, True, GREEDY)], []).results
            assert r.status is ItemStatus.OK and r.token_id is not None, r.error
            cached, out = r.cached_tokens, [r.token_id]
            for k in range(1, 8):
                (r,) = steps.step([], [DecodeItem(f"s{i}", out[-1], len(prompt) + k - 1, GREEDY, k)]).results
                assert r.status is ItemStatus.OK and r.token_id is not None, r.error
                out.append(r.token_id)
            steps.release([f"s{i}"])
            runs[on] = (out, cached)
        assert runs[True][0] == runs[False][0], tok.decode(runs[True][0])
        assert runs[False][1] == 0
        want = _expected_cached(prompt, prompts[:i], bs=16)
        assert runs[True][1] == want
        if i:
            assert want >= (system_len // 16) * 16 - 16  # most of the system prompt
    s = drivers[True].engine.stats()
    assert s.prefix_cache_hits > 0 and s.prefix_cache_queries == sum(len(p) for p in prompts)

"""Prefix caching on the worker: the allocator's reference counts and LRU of cached blocks, the
books' hash chain, and the engine's reuse of shared prompt prefixes, token-exact with caching
off in both KV view modes (tiny model here; one SmolLM2 case with a 200-token system prompt)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pytest

from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_logits
from kvfleet_models.tiny import tiny_weights
from worker_svc.block_allocator import BlockAllocator, KVBookkeeper, OutOfBlocks, block_hash
from worker_svc.engine import DecodeItem, Engine, EngineConfig, ItemStatus, PrefillItem, SamplingSpec
from worker_svc.kv_views_mode import KVViewsMode

GREEDY = SamplingSpec()
TINY = tiny_config()
TINY_WEIGHTS = tiny_weights(TINY, seed=0)
BS = 4


def _tokens(n: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt + 3) % TINY.vocab_size for i in range(n)]


def _check_books(books: KVBookkeeper) -> None:
    """Nothing leaks: free + used == total, each used block's count is its holders."""
    alloc = books.allocator
    assert alloc.num_free + alloc.num_used == alloc.num_blocks
    held: dict[int, int] = {}
    for sid in books.session_ids():
        table = books.blocks(sid)
        assert len(table) == len(set(table)) == -(-books.num_tokens(sid) // books.block_size)
        for b in table:
            held[b] = held.get(b, 0) + 1
    assert len(held) == alloc.num_used
    assert all(alloc.refcount(b) == n for b, n in held.items())


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


# -- books ------------------------------------------------------------------------------------


def test_hash_chain_names_the_whole_prefix() -> None:
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert block_hash(None, a) == block_hash(None, list(a))  # stable, content-derived
    # the same block after a different parent is a different prefix
    assert block_hash(block_hash(None, a), b) != block_hash(block_hash(None, b), b)
    assert block_hash(None, [1, 2, 3, 4]) != block_hash(None, [1, 2, 3, 5])


def test_books_reuse_published_full_blocks_and_leave_one_token_to_compute() -> None:
    books = KVBookkeeper(BS, BlockAllocator(16), prefix_caching=True)
    prompt = _tokens(10, 1)  # two full blocks and a partial one
    cached, slots = books.append_prefill("a", prompt)
    assert cached == 0 and len(slots) == 10
    # Before publish (the forward has not written the K/V yet) nothing is offered.
    assert books.append_prefill("b", prompt)[0] == 0
    books.release("b")
    books.publish("a")
    cached, slots = books.append_prefill("c", prompt[:9] + [0, 1, 2])
    assert cached == 8 and len(slots) == 4
    assert books.blocks("c")[:2] == books.blocks("a")[:2]
    # A prompt of exactly two blocks reuses one: its last token must still run for logits.
    assert books.append_prefill("d", prompt[:8])[0] == 4
    assert books.prefix_queries == 10 + 10 + 12 + 8 and books.prefix_hits == 8 + 4
    _check_books(books)
    for sid in ("a", "c", "d"):
        books.release(sid)
        _check_books(books)
    assert books.allocator.num_used == 0 and books.allocator.num_cached == 2  # a's full blocks


def test_decode_tokens_fill_blocks_that_later_prompts_reuse() -> None:
    books = KVBookkeeper(BS, BlockAllocator(16), prefix_caching=True)
    prompt = _tokens(6, 2)
    books.append_prefill("a", prompt)
    generated = [9, 8, 7]
    for t in generated:
        books.append("a", 1, [t])
    books.publish("a")
    books.release("a")
    cached, _ = books.append_prefill("b", prompt + generated + [1])
    assert cached == 8  # both blocks, the second filled by decode tokens


def test_a_cache_salt_shares_blocks_only_within_its_namespace() -> None:
    books = KVBookkeeper(BS, BlockAllocator(32), prefix_caching=True)
    prompt = _tokens(9, 5)  # two full blocks
    books.append_prefill("a", prompt, salt=b"tenant-a")
    books.publish("a")
    assert books.append_prefill("b", prompt, salt=b"tenant-b")[0] == 0  # another tenant: computed
    assert books.append_prefill("plain", prompt)[0] == 0  # the unsalted namespace is apart too
    assert books.append_prefill("a2", prompt, salt=b"tenant-a")[0] == 8  # the same tenant reuses
    # Decode tokens extend a salted chain in its namespace: a later prompt of the same tenant
    # reuses the block they filled, another tenant's does not.
    other = _tokens(5, 6)
    books.append_prefill("d", other[:3], salt=b"tenant-a")
    books.append("d", 1, [other[3]])
    books.publish("d")
    books.release("d")
    assert books.append_prefill("d2", other, salt=b"tenant-a")[0] == 4
    assert books.append_prefill("d3", other, salt=b"tenant-c")[0] == 0
    assert books.append_prefill("d4", other)[0] == 0
    for sid in books.session_ids():
        books.release(sid)
    _check_books(books)
    # A salted first chunk that does not fit changes nothing, its salt included.
    small = KVBookkeeper(BS, BlockAllocator(1), prefix_caching=True)
    with pytest.raises(OutOfBlocks):
        small.append_prefill("x", prompt, salt=b"tenant-a")
    assert not small.has("x") and small._salt == {}


def test_out_of_blocks_with_a_reused_prefix_leaves_the_books_unchanged() -> None:
    books = KVBookkeeper(BS, BlockAllocator(4), prefix_caching=True)
    prompt = _tokens(9, 3)
    books.append_prefill("a", prompt)  # 3 blocks
    books.publish("a")
    books.release("a")
    assert books.allocator.num_cached == 2
    # Reusing 2 cached blocks takes them from the free pool too: 2 + 3 new > 4.
    with pytest.raises(OutOfBlocks):
        books.append_prefill("b", prompt[:8] + _tokens(9, 4))
    assert not books.has("b") and books.allocator.num_cached == 2 and books.allocator.num_used == 0
    assert books.prefix_queries == 9 and books.prefix_hits == 0
    _check_books(books)


def test_books_without_prefix_caching_never_name_blocks() -> None:
    books = KVBookkeeper(BS, BlockAllocator(8))
    prompt = _tokens(9, 1)
    books.append_prefill("a", prompt)
    books.publish("a")
    books.release("a")
    assert books.append_prefill("b", prompt)[0] == 0
    assert books.allocator.num_cached == 0 and books.prefix_queries == 0


# -- engine -----------------------------------------------------------------------------------


def _engine(prefix_caching: bool, kv_views: str = "rebuild", num_blocks: int = 64, block_size: int = BS) -> Engine:
    return Engine(
        TINY,
        TINY_WEIGHTS,
        EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            kv_views=KVViewsMode.parse(kv_views),
            prefix_caching=prefix_caching,
        ),
    )


def _generate(
    engine: Engine, sid: str, prompt: Sequence[int], new: int, chunk: int = 0
) -> tuple[list[int], int, np.ndarray]:
    """Greedy: (generated tokens, cached tokens over all chunks, the first token's logits)."""
    chunk = chunk or len(prompt)
    cached, pos = 0, 0
    while True:
        part = tuple(prompt[pos : pos + chunk])
        last = pos + len(part) == len(prompt)
        out = engine.step([PrefillItem(sid, part, pos, last, GREEDY)], [], return_logits=last)
        (r,) = out.results
        assert r.status is ItemStatus.OK
        cached += r.cached_tokens
        pos += len(part)
        if last:
            break
    assert out.logits is not None and r.token_id is not None
    first_logits = out.logits[0]
    tokens = [r.token_id]
    for i in range(1, new):
        (r,) = engine.step([], [DecodeItem(sid, tokens[-1], len(prompt) + i - 1, GREEDY, i)]).results
        assert r.status is ItemStatus.OK and r.cached_tokens == 0 and r.token_id is not None
        tokens.append(r.token_id)
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
    on, off = _engine(True, kv_views), _engine(False, kv_views)
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
        _check_books(on.books)
    s = on.stats()
    assert s.prefix_cache_queries == sum(len(p) for p in prompts)
    assert s.prefix_cache_hits == sum(_expected_cached(p, prompts[:i]) for i, p in enumerate(prompts)) > 0
    assert s.prefill_tokens == off.stats().prefill_tokens == sum(len(p) for p in prompts)
    assert s.used_blocks == 0 and s.free_blocks == 64 and s.cached_blocks > 0
    assert off.stats().prefix_cache_queries == off.stats().cached_blocks == 0


def test_engine_reuse_across_kv_view_modes_and_chunks() -> None:
    """A prefix computed under one view mode, reused by a chunked prefill under the other while
    its first holder is still running: the persistent row is filled from the shared blocks."""
    on, off = _engine(True), _engine(False)
    prefix = _tokens(33, 11)
    first = prefix + _tokens(5, 12)
    second = prefix + _tokens(9, 13)
    first_tok: dict[str, int] = {}
    for name, engine in (("on", on), ("off", off)):
        (r,) = engine.step([PrefillItem("a", tuple(first), 0, True, GREEDY)], [], kv_views="rebuild").results
        assert r.token_id is not None
        first_tok[name] = r.token_id
    cached, pos, tokens = 0, 0, dict[str, int]()
    for chunk in (10, 10, 10, 12):
        part = tuple(second[pos : pos + chunk])
        last = pos + chunk == len(second)
        for name, engine in (("on", on), ("off", off)):
            (r,) = engine.step([PrefillItem("b", part, pos, last, GREEDY)], [], kv_views="persistent").results
            assert r.status is ItemStatus.OK and r.kv_tokens == pos + chunk
            if name == "on":
                cached += r.cached_tokens
            if last:
                assert r.token_id is not None
                tokens[name] = r.token_id
        pos += chunk
    # chunks at 0, 10, 20, 30: only those starting on a block boundary look up (0 and 20);
    # each keeps its last token to compute: 8 of [0, 10), 8 of [20, 30).
    assert cached == 16
    assert tokens["on"] == tokens["off"]
    # Both sessions decode on together over their shared blocks, still token-exact.
    for _ in range(3):
        got = {}
        for name, engine in (("on", on), ("off", off)):
            decode = [
                DecodeItem("a", first_tok[name], engine.books.num_tokens("a"), GREEDY, 1),
                DecodeItem("b", tokens[name], engine.books.num_tokens("b"), GREEDY, 1),
            ]
            got[name] = [r.token_id or 0 for r in engine.step([], decode, kv_views="persistent").results]
        assert got["on"] == got["off"]
        first_tok = {n: g[0] for n, g in got.items()}
        tokens = {n: g[1] for n, g in got.items()}
    _check_books(on.books)
    assert len(set(on.books.blocks("a")) & set(on.books.blocks("b"))) == 4  # 16 shared tokens


def test_sessions_with_one_prefix_in_one_step_compute_it_each_then_publish_one_copy() -> None:
    on, off = _engine(True), _engine(False)
    prefix = _tokens(20, 14)
    items = [PrefillItem(s, tuple(prefix + _tokens(2, k)), 0, True, GREEDY) for k, s in enumerate("ab")]
    both = on.step(items, []).results
    assert [r.cached_tokens for r in both] == [0, 0]  # neither's blocks were written yet
    assert [r.token_id for r in both] == [r.token_id for r in off.step(items, []).results]
    third = prefix + _tokens(2, 3)
    got, cached, _ = _generate(on, "c", third, 3)
    assert cached == 20 and got == _generate(off, "c", third, 3)[0]
    # One of the two computed copies was published; the other stays private and plainly freed.
    on.release(["a", "b"])
    assert on.books.allocator.num_cached == 0  # c still holds the five published blocks
    on.release(["c"])
    _check_books(on.books)
    # a's five prefix blocks plus c's sixth (filled by its decode tokens): 22 + 2 tokens held
    assert on.books.allocator.num_cached == 6


@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
def test_eviction_under_pressure_keeps_tokens_exact(kv_views: str) -> None:
    """A cache of 12 blocks: later sessions evict earlier prefixes (least recently released
    first) and a reused prefix that was evicted is recomputed, never read stale."""
    on, off = _engine(True, kv_views, num_blocks=12), _engine(False, kv_views, num_blocks=12)
    a, b = _tokens(24, 20), _tokens(24, 21)
    plan = [("a1", a + [1]), ("b1", b + [2]), ("a2", a + [3]), ("b2", b + [4]), ("c", _tokens(40, 22)), ("a3", a)]
    cached_seen = {}
    for sid, prompt in plan:
        got, cached, _ = _generate(on, sid, prompt, 4)
        assert got == _generate(off, sid, prompt, 4)[0], sid
        cached_seen[sid] = cached
        on.release([sid])
        off.release([sid])
        _check_books(on.books)
        assert on.books.allocator.num_cached <= 12
    assert cached_seen["a1"] == cached_seen["b1"] == 0
    # Each 7-block session evicts two of the previous one's blocks: its tail (released first,
    # so least recent), never the leading blocks, so 5 of the 6 prefix blocks are still found.
    assert cached_seen["a2"] == cached_seen["b2"] == 20
    # c's 11 blocks leave only the most recently released block (b2's first): a is recomputed.
    assert cached_seen["a3"] == 0
    assert on.stats().free_blocks == 12


def test_out_of_blocks_when_reuse_cannot_fit_is_a_result_and_changes_nothing() -> None:
    engine = _engine(True, num_blocks=6)
    prompt = _tokens(16, 30)
    _generate(engine, "a", prompt + [1], 1)
    engine.release(["a"])
    engine.step([PrefillItem("big", tuple(_tokens(12, 31)), 0, True, GREEDY)], [])  # 3 blocks held
    before = engine.stats()
    (r,) = engine.step([PrefillItem("b", tuple(prompt + _tokens(9, 32)), 0, True, GREEDY)], []).results
    assert r.status is ItemStatus.OUT_OF_BLOCKS and r.cached_tokens == 0
    after = engine.stats()
    assert (after.used_blocks, after.free_blocks, after.out_of_blocks) == (
        before.used_blocks,
        before.free_blocks,
        before.out_of_blocks + 1,
    )
    assert not engine.books.has("b")


def test_prefix_caching_off_is_the_plain_engine() -> None:
    engine = _engine(False)
    prompt = _tokens(20, 40)
    for sid in ("a", "b"):
        _, cached, _ = _generate(engine, sid, prompt, 2)
        assert cached == 0
        engine.release([sid])
    s = engine.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.cached_blocks) == (0, 0, 0)


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

    engine = _engine(True)
    prompt = _tokens(30, 50)
    for sid in ("a", "b"):
        _generate(engine, sid, prompt, 1)
        engine.release([sid])
    metrics = WorkerMetrics(engine, "w")
    metrics.refresh()
    text = generate_latest(metrics.registry).decode()
    s = engine.stats()
    assert s.prefix_cache_hits == 28 and s.prefix_cache_queries == 60
    for name in ("hits", "queries"):  # the TYPE line names a counter with or without _total
        assert re.search(rf"^# TYPE kvfleet:worker_prefix_cache_{name}(_total)? counter$", text, re.M), name
    assert f"kvfleet:worker_prefix_cache_hits_total {float(s.prefix_cache_hits)}" in text
    assert f"kvfleet:worker_prefix_cache_queries_total {float(s.prefix_cache_queries)}" in text
    assert f"kvfleet:worker_prefix_cache_blocks {float(s.cached_blocks)}" in text


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
    engines = {
        on: Engine(cfg, weights, EngineConfig(num_blocks=128, kv_views=KVViewsMode.parse(kv_views), prefix_caching=on))
        for on in (True, False)
    }
    for i, prompt in enumerate(prompts):
        runs = {}
        for on, engine in engines.items():
            (r,) = engine.step([PrefillItem(f"s{i}", tuple(prompt), 0, True, GREEDY)], []).results
            assert r.token_id is not None
            cached, out = r.cached_tokens, [r.token_id]
            for k in range(1, 8):
                (r,) = engine.step([], [DecodeItem(f"s{i}", out[-1], len(prompt) + k - 1, GREEDY, k)]).results
                assert r.token_id is not None
                out.append(r.token_id)
            engine.release([f"s{i}"])
            runs[on] = (out, cached)
        assert runs[True][0] == runs[False][0], tok.decode(runs[True][0])
        assert runs[False][1] == 0
        want = _expected_cached(prompt, prompts[:i], bs=16)
        assert runs[True][1] == want
        if i:
            assert want >= (system_len // 16) * 16 - 16  # most of the system prompt
    s = engines[True].stats()
    assert s.prefix_cache_hits > 0 and s.prefix_cache_queries == sum(len(p) for p in prompts)

"""The hand-fused C ops (worker_svc/model/fused.py): each against torch's ops on the same
inputs, the engine with them against the engine without them in every CPU mode, and the
fallback when they cannot be built; the package's build of the library against the first-use
compile a checkout without one makes (into the tests' cache folder). No timing is asserted (bench.modes measures them:
``--modes int8-torchops,int8``)."""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvfleet_models.tiny import tiny_weights
from tests.unit.model_configs import GQA_CFG
from worker_svc.engine import DecodeItem, Engine, EngineConfig, PrefillItem, SamplingSpec
from worker_svc.kv_cache import BlockTable, PagedKVCache, PagedRows, PersistentViews, RebuildViews, SlabRows
from worker_svc.local import LocalSteps
from worker_svc.model import fused, native
from worker_svc.model.cpu_features import cpu_features
from worker_svc.model.llama import LlamaModel

# Their rows split among 2 threads, whatever the process has (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("two_threads")

NO_OPS = "no C compiler here: the fallback tests cover this machine"
GREEDY = SamplingSpec()
CFG = GQA_CFG
WEIGHTS = tiny_weights(CFG, seed=5)


@pytest.fixture(scope="module", autouse=True)
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every build of this module's tests (fused.load, and the engines' through it) goes to a
    folder of pytest's, not the user's cache (~/.cache/kvfleet); load() is cached, so it is
    cleared on the way in (a handle from another folder) and out (one from this folder)."""
    folder = tmp_path_factory.mktemp("kvfleet-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFLEET_CACHE_DIR", str(folder))
        fused.load.cache_clear()
        try:
            yield folder
        finally:
            fused.load.cache_clear()


@pytest.fixture(scope="module")
def ops(build_dir: Path) -> fused.FusedOps:
    """The C ops: the package's build where there is one, else built into ``build_dir``; the
    test is skipped where they cannot be built."""
    loaded = fused.load()
    if loaded is None:
        pytest.skip(NO_OPS)
    if loaded.origin is native.Origin.INSTALLED:
        assert loaded.path.parent == native.HERE
    else:
        assert loaded.path.parent == build_dir / "fused"
    return loaded


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_norms_match_torch(ops: fused.FusedOps, rows: int) -> None:
    x, w, y = _rand(rows, 576, seed=1), _rand(576, seed=2), _rand(rows, 576, seed=3)
    want = F.rms_norm(x, (576,), w, 1e-5)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-5)
    h = x.clone()
    got = ops.add_rms_norm_(h, y, w, 1e-5)
    torch.testing.assert_close(h, x + y, rtol=0, atol=0)  # the residual add is exact
    torch.testing.assert_close(got, F.rms_norm(x + y, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rope_rotates_only_q_and_k_in_place(ops: fused.FusedOps) -> None:
    """qkv rows hold q and k heads, then v; only the first ``heads`` heads turn, as torch's
    complex multiply turns them."""
    t, heads, kv_heads, d = 4, 6, 2, 16
    qkv = _rand(t, (heads + 2 * kv_heads) * d, seed=5)
    angles = _rand(t, d // 2, seed=6)
    rot = torch.polar(torch.ones_like(angles), angles)  # [T, D/2] complex64
    want = qkv.clone()
    width = (heads + kv_heads) * d
    qk = want[:, :width].reshape(t, heads + kv_heads, d // 2, 2)
    torch.view_as_complex(qk).mul_(rot[:, None])
    got = qkv.clone()
    ops.rope_(got, rot, heads + kv_heads, d // 2)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[:, width:], qkv[:, width:])  # v untouched


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("order", ["bh", "hb"])
@pytest.mark.parametrize(
    "items, hkv, d, s",
    [
        (3, 2, 16, 11),
        (1, 3, 16, 11),  # a batch-1 decode: 3 rows x 3 heads, shared among the threads by (row, head)
        (4, 3, 64, 37),  # 12 rows of head size 64: on AVX-512 a row's heads together, 16 keys at a time
        (1, 3, 64, 37),  # 3 rows of head size 64: on AVX-512 a head at a time, 16 keys at a time
        (2, 2, 128, 21),  # head size 128, a constant of its own
        (2, 1, 96, 19),  # any other head size
    ],
)
def test_decode_attention_matches_masked_softmax(
    ops: fused.FusedOps, order: str, items: int, hkv: int, d: int, s: int, kv_dtype: torch.dtype
) -> None:
    """Items of different lengths in a padded, strided slab view: the lengths do what the
    additive mask does in torch's path. A float16 K/V (the reduced-precision modes' cache) is
    widened exactly, so it is held to the same float32 reference of the float16 values."""
    g = 3
    slab = _rand(2, items * hkv, 48, d, seed=7).to(kv_dtype)  # capacity 48, S used: rows are strided
    kv = slab[:, :, :s]
    wide = kv.float()
    q3 = _rand(items * hkv, g, d, seed=8)
    lens = torch.tensor([s, 4, s - 4, 17][:items], dtype=torch.int64)
    item_of_row = [n // hkv if order == "bh" else n % items for n in range(items * hkv)]
    allowed = torch.arange(s)[None, :] < lens[item_of_row][:, None]  # [N, S]
    scores = q3 @ wide[0].transpose(1, 2) + torch.where(allowed, 0.0, float("-inf"))[:, None, :]
    want = torch.softmax(scores, -1) @ wide[1]
    got = ops.decode_attention(q3, kv, lens, order == "bh", items, hkv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        ops.decode_attention(q3, kv, None, order == "bh", items, hkv),
        torch.softmax(q3 @ wide[0].transpose(1, 2), -1) @ wide[1],
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="lens"):
        ops.decode_attention(q3, kv, lens.int(), order == "bh", items, hkv)
    # A sliding window: each item sees keys [first, len) only.
    firsts = torch.clamp(lens - 5, min=0)
    seen = allowed & (torch.arange(s)[None, :] >= firsts[item_of_row][:, None])
    windowed = q3 @ wide[0].transpose(1, 2) + torch.where(seen, 0.0, float("-inf"))[:, None, :]
    torch.testing.assert_close(
        ops.decode_attention(q3, kv, lens, order == "bh", items, hkv, firsts=firsts),
        torch.softmax(windowed, -1) @ wide[1],
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="firsts"):
        ops.decode_attention(q3, kv, None, order == "bh", items, hkv, firsts=firsts)


def test_decode_attention_refuses_other_dtypes(ops: fused.FusedOps) -> None:
    q3, kv = _rand(2, 3, 16, seed=1), _rand(2, 2, 5, 16, seed=2)
    with pytest.raises(ValueError, match="float32 or float16 K/V, got torch.float32 and torch.bfloat16"):
        ops.decode_attention(q3, kv.bfloat16(), None, True, 1, 2)
    with pytest.raises(ValueError, match="float32 queries"):
        ops.decode_attention(q3.half(), kv.half(), None, True, 1, 2)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hkv, d, s", [(2, 16, 11), (3, 64, 37)])
def test_decode_attention_reads_scattered_slab_rows(
    ops: fused.FusedOps, hkv: int, d: int, s: int, kv_dtype: torch.dtype
) -> None:
    """Items in rows 0, 2 and 4 of a persistent slab [2, R, Hkv, cap, D] (S cut from its
    capacity): read where they lie, the result is the gathered-rows call's, bit for bit."""
    items, g = 3, 3
    slab = _rand(2, 6, hkv, 48, d, seed=9).to(kv_dtype)[:, :, :, :s]
    rows = torch.tensor([0, 2, 4], dtype=torch.int64)
    q3 = _rand(items * hkv, g, d, seed=10)
    lens = torch.tensor([s, 4, s - 4], dtype=torch.int64)
    gathered = slab[:, rows].reshape(2, items * hkv, s, d)
    want = ops.decode_attention(q3, gathered, lens, True, items, hkv)
    assert torch.equal(ops.decode_attention(q3, slab, lens, True, items, hkv, rows), want)
    with pytest.raises(ValueError, match="bh order"):
        ops.decode_attention(q3, slab, lens, False, items, hkv, rows)
    with pytest.raises(ValueError, match="past the slab"):
        ops.decode_attention(q3, slab, lens, True, items, hkv, torch.tensor([0, 2, 6]))


def _store_case(kv_dtype: torch.dtype, d: int, seed: int) -> tuple[PagedKVCache, torch.Tensor, torch.Tensor]:
    """A 3-layer cache of random contents, and a step's qkv (5 rows, 2 query heads and 2 K/V
    heads, rows wider than their columns: a view into a wider buffer) with values that round
    in float16: halfway cases, subnormals and overflows among them."""
    cache = PagedKVCache(3, 8, 4, 2, d, kv_dtype, torch.device("cpu"))
    cache.kv.copy_(_rand(*cache.kv.shape, seed=seed).to(kv_dtype))
    qkv = _rand(5, 6 * d + 3, seed=seed + 1)[:, : 6 * d]
    qkv[0, 2 * d : 2 * d + 6] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1e-6, -3e-7, 7e4, -1e9])
    return cache, qkv, torch.tensor([9, 30, 0, 17, 31], dtype=torch.int64)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [64, 12])  # whole vectors; a head shorter than one (the scalar tail)
def test_kv_store_writes_as_torchs_index_copy(ops: fused.FusedOps, kv_dtype: torch.dtype, d: int) -> None:
    """The C write of a step's new K/V is the torch path's, bit for bit: the same slots of
    every head of the layer written, float16 rounded as torch rounds, nothing else touched."""
    cache, qkv, slots = _store_case(kv_dtype, d, seed=21)
    want = cache.kv.clone()
    new = qkv[:, 2 * d :].view(5, 2, 2, d).to(kv_dtype)
    want[1].index_copy_(2, slots, new.permute(1, 2, 0, 3))
    store = ops.kv_store_plan(cache.kv, slots, qkv, 2 * d)
    store(1, qkv)
    assert torch.equal(cache.kv, want)
    assert torch.isinf(cache.kv[1, 0, 0, 9, 4:6].float()).all() == (kv_dtype == torch.float16)


def test_kv_store_refuses_what_it_cannot_write(ops: fused.FusedOps) -> None:
    cache, qkv, slots = _store_case(torch.float32, 16, seed=22)
    with pytest.raises(ValueError, match="outside the cache"):
        ops.kv_store_plan(cache.kv, torch.tensor([0, 1, 2, 3, 32]), qkv, 32)
    with pytest.raises(ValueError, match="outside the cache"):
        ops.kv_store_plan(cache.kv, torch.tensor([0, 1, -1, 3, 4]), qkv, 32)
    with pytest.raises(ValueError, match="K/V from column"):
        ops.kv_store_plan(cache.kv, slots, qkv, 40)  # the V heads would run past the row
    with pytest.raises(ValueError, match="float32 or float16"):
        ops.kv_store_plan(cache.kv.to(torch.bfloat16), slots, qkv, 32)
    with pytest.raises(ValueError, match="one per row"):
        ops.kv_store_plan(cache.kv, slots[:4], qkv, 32)
    store = ops.kv_store_plan(cache.kv, slots, qkv, 32)
    before = cache.kv.clone()
    for bad in (qkv.contiguous(), qkv[:4], qkv.t().contiguous().t()):  # other strides or rows
        assert not store.fits(bad)
        with pytest.raises(ValueError, match="laid out"):
            store(0, bad)
    with pytest.raises(ValueError, match="no such layer"):
        store(3, qkv)
    assert torch.equal(cache.kv, before)


def _paged(hkv: int, d: int, block_size: int, kv_dtype: torch.dtype, seed: int) -> PagedKVCache:
    """A one-layer paged cache of 12 blocks filled with random K/V."""
    cache = PagedKVCache(1, 12, block_size, hkv, d, kv_dtype, torch.device("cpu"))
    cache.kv.copy_(_rand(*cache.kv.shape, seed=seed).to(kv_dtype))
    return cache


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("order", ["bh", "hb"])
@pytest.mark.parametrize(
    "hkv, d, block_size, s",
    [
        (2, 16, 4, 11),  # (row, head) units, a block of 4 keys at a time
        (3, 64, 16, 37),  # 9 rows of head size 64: on AVX-512 16 keys (a block) at a time
        (3, 64, 4, 37),  # the same, blocks shorter than 16 keys
        (1, 64, 16, 45),  # 3 rows: a head at a time
        (2, 128, 8, 21),
        (2, 96, 4, 19),
    ],
)
def test_decode_attention_reads_a_paged_cache_where_it_lies(
    ops: fused.FusedOps, order: str, hkv: int, d: int, block_size: int, s: int, kv_dtype: torch.dtype
) -> None:
    """Items whose blocks are scattered through the cache, out of order, with different
    lengths: read block by block where they lie, the result is torch's masked softmax over the
    gathered keys (``PagedRows.merged``); where the blocks hold 16 keys (the AVX-512 path's
    unit) it is the gathered call's, bit for bit."""
    items, g = 3, 3
    cache = _paged(hkv, d, block_size, kv_dtype, seed=13)
    blocks = -(-s // block_size)
    tables = tuple(tuple(int(b) for b in np.random.default_rng(i).permutation(12)[:blocks]) for i in range(items))
    lens = torch.tensor([s, 4, s - 5], dtype=torch.int64)
    paged = PagedRows(cache, 0, cache.block_table(tables, s))
    gathered = paged.merged()  # [2, Hkv * B, S, D], hb order
    if order == "bh":  # the same keys in (item, head) order
        gathered = gathered.view(2, hkv, items, s, d).transpose(1, 2).reshape(2, items * hkv, s, d)
    q3 = _rand(items * hkv, g, d, seed=14)
    bh = order == "bh"
    got = ops.decode_attention(q3, paged.kv, lens, bh, items, hkv, pages=paged.table)
    item_of_row = [n // hkv if bh else n % items for n in range(items * hkv)]
    allowed = torch.arange(s)[None, :] < lens[item_of_row][:, None]
    wide = gathered.float()
    scores = q3 @ wide[0].transpose(1, 2) + torch.where(allowed, 0.0, float("-inf"))[:, None, :]
    torch.testing.assert_close(got, torch.softmax(scores, -1) @ wide[1], rtol=1e-5, atol=1e-5)
    if block_size % 16 == 0:
        assert torch.equal(got, ops.decode_attention(q3, gathered, lens, bh, items, hkv))
    if bh:  # the queries read in place from a step's qkv rows ([B, (Hq + 2 Hkv) D]): the same
        qkv = torch.cat([q3.reshape(items, hkv * g * d), _rand(items, 2 * hkv * d, seed=19)], dim=1)
        rows_out = ops.decode_attention(qkv[:, : hkv * g * d], paged.kv, lens, True, items, hkv, pages=paged.table)
        assert rows_out.shape == (items, hkv * g * d)
        assert torch.equal(rows_out.view(items * hkv, g, d), got)
    else:
        with pytest.raises(ValueError, match="bh order"):
            ops.decode_attention(q3.reshape(items, -1), paged.kv, lens, False, items, hkv, pages=paged.table)
    # A sliding window, its first key inside a block: keys [first, len) only, read in place.
    firsts = torch.tensor([s - 7, 1, max(s - 5 - block_size - 1, 0)], dtype=torch.int64)
    seen = allowed & (torch.arange(s)[None, :] >= firsts[item_of_row][:, None])
    windowed = q3 @ wide[0].transpose(1, 2) + torch.where(seen, 0.0, float("-inf"))[:, None, :]
    torch.testing.assert_close(
        ops.decode_attention(q3, paged.kv, lens, bh, items, hkv, pages=paged.table, firsts=firsts),
        torch.softmax(windowed, -1) @ wide[1],
        rtol=1e-5,
        atol=1e-5,
    )
    all_keys = ops.decode_attention(q3, paged.kv, None, bh, items, hkv, pages=paged.table)
    torch.testing.assert_close(
        all_keys, torch.softmax(q3 @ wide[0].transpose(1, 2), -1) @ wide[1], rtol=1e-5, atol=1e-5
    )


def test_paged_decode_attention_refuses_what_it_cannot_read(ops: fused.FusedOps) -> None:
    cache = _paged(2, 16, 4, torch.float32, seed=15)
    q3 = _rand(2 * 2, 3, 16, seed=16)
    table = cache.block_table(((3, 1), (0, 11)), 7)
    kv = cache.kv[0]
    past = BlockTable(table.ids.clone().fill_(12), 4, 7, 12)
    with pytest.raises(ValueError, match="past the cache"):
        ops.decode_attention(q3, kv, None, False, 2, 2, pages=past)
    short = BlockTable(table.ids, 4, 9, table.max_id)  # 9 keys in 2 blocks of 4
    with pytest.raises(ValueError, match="covering its keys"):
        ops.decode_attention(q3, kv, None, False, 2, 2, pages=short)
    with pytest.raises(ValueError, match="paged cache"):
        ops.decode_attention(q3, PagedRows(cache, 0, table).merged(), None, False, 2, 2, pages=table)


def test_a_decode_attention_plan_runs_each_layer_as_its_own_call(ops: fused.FusedOps) -> None:
    """A plan made on layer 0 runs layer 1 (its own queries and K/V) as a call made for layer
    1 would, bit for bit, and is refused (``matches``) for any other argument: another lens or
    block table (equal values, another tensor), other queries' or K/V's layout or dtype."""
    hkv, g, d, s, items = 2, 3, 16, 11, 2
    cache = PagedKVCache(2, 12, 4, hkv, d, torch.float32, torch.device("cpu"))
    cache.kv.copy_(_rand(*cache.kv.shape, seed=21))
    table = cache.block_table(((3, 1, 7), (0, 11, 5)), s)
    lens = torch.tensor([s, 6], dtype=torch.int64)
    qkv = [_rand(items, (hkv * g + 2 * hkv) * d, seed=22 + layer) for layer in range(2)]
    q = [x[:, : hkv * g * d] for x in qkv]  # read in place from each layer's projection
    plan = ops.decode_attention_plan(q[0], cache.kv[0], lens, True, items, hkv, None, table, None)
    for layer in range(2):
        assert plan.matches(q[layer], cache.kv[layer], lens, True, items, hkv, None, table, None)
        want = ops.decode_attention(q[layer], cache.kv[layer], lens, True, items, hkv, pages=table)
        assert torch.equal(plan(q[layer], cache.kv[layer]), want)
    assert not torch.equal(plan(q[1], cache.kv[1]), plan(q[0], cache.kv[0]))  # each layer its own
    same = (q[1], cache.kv[1], lens, True, items, hkv, None, table, None)
    others = {
        "lens": (q[1], cache.kv[1], lens.clone(), True, items, hkv, None, table, None),
        "table": (q[1], cache.kv[1], lens, True, items, hkv, None, cache.block_table(((3, 1, 7), (0, 11, 5)), s), None),
        "firsts": (q[1], cache.kv[1], lens, True, items, hkv, None, table, torch.zeros(items, dtype=torch.int64)),
        "q layout": (q[1].contiguous(), cache.kv[1], lens, True, items, hkv, None, table, None),
        "kv dtype": (q[1], cache.kv[1].half(), lens, True, items, hkv, None, table, None),
        "order": (q[1], cache.kv[1], lens, False, items, hkv, None, table, None),
    }
    assert plan.matches(*same)
    for what, args in others.items():
        assert not plan.matches(*args), what
    with pytest.raises(ValueError, match="not laid out as the plan's"):
        plan(q[1].contiguous(), cache.kv[1])  # read by the plan's strides, it would be misread
    with pytest.raises(ValueError, match="not laid out as the plan's"):
        plan(q[1], cache.kv[1].half())
    strided = _rand(items * hkv, d, g, seed=24).transpose(1, 2)  # [N, G, D], not contiguous
    with pytest.raises(ValueError, match="must be contiguous"):
        ops.decode_attention_plan(strided, cache.kv[0], lens, True, items, hkv, None, table, None)


def test_a_decode_step_plans_its_attention_once_for_every_layer(ops: fused.FusedOps, monkeypatch) -> None:
    """One plan a step (one decode group), run by each layer; the next step plans anew (its
    lengths changed)."""
    made, runs = [], []
    plan, run = fused.FusedOps.decode_attention_plan, fused.DecodeAttention.__call__

    def counted_plan(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(1)
        return plan(self, *args, **kwargs)

    def counted_run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        runs.append(1)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(fused.FusedOps, "decode_attention_plan", counted_plan)
    monkeypatch.setattr(fused.DecodeAttention, "__call__", counted_run)
    config = EngineConfig(block_size=4, num_blocks=32, fused_ops=True, whole_steps=False)  # the per-op path
    steps = LocalSteps(Engine(CFG, WEIGHTS, config))
    out = steps.step([PrefillItem(s, (1, 2, 3, 4, 5)[: 3 + k], 0, True, GREEDY) for k, s in enumerate("ab")], [])
    tokens = [r.token_id for r in out.results]
    for i in range(2):
        made.clear(), runs.clear()
        out = steps.step([], [DecodeItem(s, tokens[k], 3 + k + i, GREEDY, 1 + i) for k, s in enumerate("ab")])
        tokens = [r.token_id for r in out.results]
        assert (len(made), len(runs)) == (1, CFG.num_layers)


def test_rebuild_decodes_read_the_paged_cache_without_a_gather(ops: fused.FusedOps, monkeypatch) -> None:
    """A step of decodes in the rebuild mode gathers nothing (its attention reads the blocks in
    place); a step with a prefill chunk gathers that group's only. The logits are the torch
    ops' (which gather every group) to float32's rounding."""
    merged: list[int] = []
    gather = PagedRows.merged

    def spy(self: PagedRows) -> torch.Tensor:
        merged.append(self.table.ids.shape[0])
        return gather(self)

    monkeypatch.setattr(PagedRows, "merged", spy)
    logits = []
    for on in (True, False):
        merged.clear()
        config = EngineConfig(block_size=4, num_blocks=64, kv_views="rebuild", fused_ops=on, whole_steps=False)
        engine = Engine(CFG, WEIGHTS, config)
        assert isinstance(engine.views, RebuildViews)
        steps = LocalSteps(engine)
        first = steps.step(
            [PrefillItem("a", (1, 2, 3, 4, 5, 6, 7), 0, True, GREEDY), PrefillItem("b", (9, 8), 0, True, GREEDY)], []
        )
        tokens = {r.session_id: r.token_id for r in first.results}
        merged.clear()
        out = steps.step(
            [],
            [DecodeItem("a", tokens["a"], 7, GREEDY, 1), DecodeItem("b", tokens["b"], 2, GREEDY, 1)],
            return_logits=True,
        )
        if on:
            assert merged == []  # read in place, every layer
        else:
            assert merged == [2] * CFG.num_layers
        logits.append(out.logits)
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-5, rtol=0)


def test_a_decode_group_in_scattered_persistent_rows_equals_rebuild(ops: fused.FusedOps, monkeypatch) -> None:
    """Sessions in rows 0, 1, 2; the middle one's second prompt chunk in the same step as the
    others' decodes: the decode group's rows (0, 2) are read from the slab in place
    (``SlabRows``), and the logits equal the rebuild mode's, which gathers whole blocks."""
    seen: list[bool] = []
    keys_values = PersistentViews.keys_values

    def spy(self, layer, group):  # type: ignore[no-untyped-def]
        kv = keys_values(self, layer, group)
        seen.append(isinstance(kv, SlabRows))
        return kv

    monkeypatch.setattr(PersistentViews, "keys_values", spy)
    prompts = {sid: tuple((5 * i + n) % CFG.vocab_size for i in range(n)) for sid, n in (("a", 7), ("b", 10), ("c", 5))}
    logits = {}
    for kv_views in ("rebuild", "persistent"):
        steps = LocalSteps(Engine(CFG, WEIGHTS, EngineConfig(block_size=4, num_blocks=64, kv_views=kv_views)))
        first = steps.step(
            [
                PrefillItem("a", prompts["a"], 0, True, GREEDY),
                PrefillItem("b", prompts["b"][:4], 0, False, GREEDY),
                PrefillItem("c", prompts["c"], 0, True, GREEDY),
            ],
            [],
        )
        tokens = {r.session_id: r.token_id for r in first.results if r.token_id is not None}
        out = steps.step(
            [PrefillItem("b", prompts["b"][4:], 4, True, GREEDY)],
            [DecodeItem("a", tokens["a"], 7, GREEDY, 1), DecodeItem("c", tokens["c"], 5, GREEDY, 1)],
            return_logits=True,
        )
        logits[kv_views] = out.logits
    assert any(seen), "the decode group's rows were consecutive: the scattered case was not reached"
    np.testing.assert_allclose(logits["persistent"], logits["rebuild"], atol=1e-6, rtol=0)


def test_decode_attention_of_an_avx2_build_equals_the_native_one(ops: fused.FusedOps, tmp_path: Path) -> None:
    """fused_ops.c is built -march=native: on an AVX-512 CPU head size 64 takes its AVX-512
    path (16 keys' sums at once, a row's heads together), on an AVX2-only one the plain C
    loops. The AVX2 build (x86-64-v3), made here, is held to the same results as the native
    one and as torch, so the level this CPU does not pick is tested too, with float32 K/V and
    float16 (widened by F16C there)."""
    if not cpu_features().avx2:
        pytest.skip("this CPU does not run AVX2 code")
    spec = native.LibSpec(
        "fused_ops_avx2", "fused_ops.c", ("-O3", "-march=x86-64-v3", "-fopenmp-simd", "-shared", "-fPIC")
    )
    path = tmp_path / "fused_ops_avx2.so"
    try:
        native.compile_library(spec, path, fused.torch_uses_libgomp())
    except RuntimeError as e:
        pytest.skip(f"the compiler cannot build for x86-64-v3: {e}")
    avx2 = fused.FusedOps(ctypes.CDLL(str(path)), path)
    # the row path (12 rows) and the (row, head) one, in both K/V types
    for (items, hkv, s), kv_dtype in itertools.product(((4, 3, 37), (1, 3, 70)), (torch.float32, torch.float16)):
        g, d = 3, 64
        kv = _rand(2, items * hkv, s, d, seed=11).to(kv_dtype)
        wide = kv.float()
        q3 = _rand(items * hkv, g, d, seed=12)
        lens = torch.tensor([s, 5, s - 4, 20][:items], dtype=torch.int64)
        allowed = torch.arange(s)[None, :] < lens[[n // hkv for n in range(items * hkv)]][:, None]
        mask = torch.where(allowed, 0.0, float("-inf"))[:, None, :]
        want = torch.softmax(q3 @ wide[0].transpose(1, 2) + mask, -1) @ wide[1]
        got = avx2.decode_attention(q3, kv, lens, True, items, hkv)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, ops.decode_attention(q3, kv, lens, True, items, hkv), rtol=1e-5, atol=1e-5)
    # a paged cache read in place, blocks of 16 and of 4 keys
    for block_size in (16, 4):
        cache = _paged(3, 64, block_size, torch.float16, seed=17)
        tables = ((5, 2, 9, 0, 7, 11, 1, 3, 4, 6, 8, 10)[: -(-37 // block_size)],) * 2
        table = cache.block_table(tables, 37)
        lens = torch.tensor([37, 9], dtype=torch.int64)
        q3 = _rand(2 * 3, 3, 64, seed=18)
        want = ops.decode_attention(q3, PagedRows(cache, 0, table).merged(), lens, False, 2, 3)
        got = avx2.decode_attention(q3, cache.kv[0], lens, False, 2, 3, pages=table)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        firsts = torch.tensor([30, 2], dtype=torch.int64)  # windows, starting inside blocks
        want = ops.decode_attention(q3, PagedRows(cache, 0, table).merged(), lens, False, 2, 3, firsts=firsts)
        got = avx2.decode_attention(q3, cache.kv[0], lens, False, 2, 3, pages=table, firsts=firsts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_kv_store_of_other_builds_equals_torchs(ops: fused.FusedOps, tmp_path: Path, march: str) -> None:
    """The float16 narrowing has three paths: AVX-512's (the native build here, where the
    CPU has it), F16C's (an AVX2 build) and plain C (a baseline x86-64 build, also every
    build's tail). The other builds are made here and held to the native build's bits, which
    ``test_kv_store_writes_as_torchs_index_copy`` holds to torch's."""
    if march == "x86-64-v3" and not cpu_features().avx2:
        pytest.skip("this CPU does not run AVX2 code")
    spec = native.LibSpec(
        f"fused_ops_{march}", "fused_ops.c", ("-O3", f"-march={march}", "-fopenmp-simd", "-shared", "-fPIC")
    )
    path = tmp_path / f"fused_ops_{march}.so"
    try:
        native.compile_library(spec, path, fused.torch_uses_libgomp())
    except RuntimeError as e:
        pytest.skip(f"the compiler cannot build for {march}: {e}")
    other = fused.FusedOps(ctypes.CDLL(str(path)), path)
    for kv_dtype, d in itertools.product((torch.float32, torch.float16), (64, 12)):
        cache, qkv, slots = _store_case(kv_dtype, d, seed=23)
        want = cache.kv.clone()
        ops.kv_store_plan(want, slots, qkv, 2 * d)(2, qkv)
        other.kv_store_plan(cache.kv, slots, qkv, 2 * d)(2, qkv)
        assert torch.equal(cache.kv, want)


def _mixed_steps(engine: Engine) -> np.ndarray:
    """Prefill chunks, then a step mixing a chunk with decodes of different lengths (a masked
    decode group), then plain decodes on a fresh engine; every step's logits."""
    steps = LocalSteps(engine)
    prompts = {n: tuple((7 * i + 3 * n) % CFG.vocab_size for i in range(n)) for n in (9, 3, 14)}
    out = []
    first = steps.step([PrefillItem(f"s{n}", p, 0, True, GREEDY) for n, p in prompts.items() if n != 14], [])
    tokens = {r.session_id: r.token_id for r in first.results}
    pos = {"s9": 9, "s3": 3}
    for k in range(3):
        prefill = [PrefillItem("s14", prompts[14], 0, True, GREEDY)] if k == 0 else []
        decode = [DecodeItem(sid, tokens[sid], pos[sid], GREEDY, k + 1) for sid in pos]
        res = steps.step(prefill, decode, return_logits=True)
        out.append(res.logits)
        for r in res.results:
            tokens[r.session_id] = r.token_id
        pos = {sid: p + 1 for sid, p in pos.items()}
        if k == 0:
            pos["s14"] = 14
    return np.concatenate(out)


@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
@pytest.mark.parametrize(
    "mode,atol",
    [
        ({}, 1e-5),
        ({"whole_steps": False}, 1e-5),
        ({"kv_dtype": "float16"}, 1e-5),
        ({"kv_dtype": "float16", "whole_steps": False}, 1e-5),
        ({"quant": "int8"}, 1e-4),
        ({"dtype": "bfloat16"}, 1e-4),
    ],
    # int8 and bf16 keep a float16 KV by default; float32 takes whole steps in the rebuild mode
    # (``LlamaModel.whole_step``) unless switched off, then the per-op path
    ids=["f32", "f32-perop", "f32-kv16", "f32-kv16-perop", "int8", "bf16"],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_engine_with_fused_ops_matches_torch_ops(
    ops: fused.FusedOps, kv_views: str, mode: dict, atol: float, threads: int
) -> None:
    """Same weights and steps with and without the C ops: the logits agree in every CPU mode,
    with either KV dtype (the C attention widens a float16 K/V as it reads it, torch's path
    before its products), and thread count (2 threads sends multi-item attention groups to torch's bmm in int8 and
    bfloat16, one thread keeps them on the host path)."""
    logits = []
    for on in (True, False):
        engine = Engine(
            CFG,
            WEIGHTS,
            EngineConfig(block_size=4, num_blocks=64, kv_views=kv_views, fused_ops=on, num_threads=threads, **mode),
        )
        assert (engine.model.fused is not None) is on
        logits.append(_mixed_steps(engine))
    assert np.isfinite(logits[0]).all()
    np.testing.assert_allclose(logits[0], logits[1], atol=atol, rtol=0)


def test_switched_off_by_environment_and_fallback_without_compiler(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    fused.load.cache_clear()
    try:
        monkeypatch.setenv("KVFLEET_FUSED_OPS", "0")
        assert fused.load() is None
        fused.load.cache_clear()
        monkeypatch.delenv("KVFLEET_FUSED_OPS")
        monkeypatch.setattr(native, "installed", lambda *a, **k: None)  # a checkout without a build
        monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails
        with caplog.at_level(logging.WARNING, logger="worker_svc.model.fused"):
            assert fused.load() is None
        assert "fused CPU ops unavailable" in caplog.text
        model = LlamaModel(CFG, WEIGHTS, torch.device("cpu"), torch.float32)
        assert model.fused is None  # the model keeps torch's ops
        with pytest.raises(RuntimeError, match="required"):
            LlamaModel(CFG, WEIGHTS, torch.device("cpu"), torch.float32, fused_ops=True)
        assert not list(tmp_path.rglob("*.so"))  # no half-built library left behind
    finally:
        fused.load.cache_clear()


def test_build_is_cached_per_source_and_cpu(ops: fused.FusedOps, tmp_path) -> None:
    first = fused.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert fused.build(tmp_path) == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_a_checkout_without_a_build_compiles_into_the_tests_cache(ops: fused.FusedOps, monkeypatch) -> None:
    """No installed library: the first-use compile goes to KVFLEET_CACHE_DIR, which the tests
    set (tests/conftest.py, then ``build_dir``), never ~/.cache; its ops equal the installed ones."""
    assert not native.cache_dir().is_relative_to(Path.home() / ".cache")
    monkeypatch.setattr(native, "installed", lambda *a, **k: None)
    fused.load.cache_clear()
    try:
        compiled = fused.load()
        assert compiled is not None and compiled.origin is native.Origin.COMPILED
        assert compiled.path.parent == Path(os.environ[native.CACHE_ENV]) / "fused"
        x, w = _rand(3, 64), _rand(64, seed=1)
        assert torch.equal(compiled.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5))
    finally:
        fused.load.cache_clear()


def test_the_package_build_is_used_where_it_fits(ops: fused.FusedOps) -> None:
    """After a package build (a wheel, ``make install``) the ops come from it, not a compile."""
    if not (native.HERE / native.installed_name(native.FUSED)).exists():
        pytest.skip("this checkout has no package build of the C libraries (make install makes one)")
    assert ops.origin is native.Origin.INSTALLED


def _fake_install(where: Path, spec: native.LibSpec, machine: dict | None = None, **entry: object) -> None:
    """An empty file where the package build puts ``spec``, with a build record: this
    machine's, changed by ``machine`` (top-level keys) and ``entry`` (the library's)."""
    (where / native.installed_name(spec)).write_bytes(b"")
    record = native.build_record({spec.name: True})
    record.update(machine or {})
    record["libraries"][spec.name].update(entry)  # type: ignore[index]
    (where / native.BUILD_INFO).write_text(json.dumps(record))


@pytest.mark.parametrize(
    "machine, entry, used",
    [
        ({}, {}, True),
        ({}, {"flags": ["-O2"]}, False),  # built with other flags
        ({}, {"source_sha256": "0" * 64}, False),  # the C source edited since
        ({"cpu_flags": ["avx9000"]}, {}, False),  # -march=native on a CPU with a flag this one lacks
        ({"machine": "riscv64"}, {}, False),
        ({"libraries": {}}, {}, False),  # a library the record does not list
    ],
)
def test_an_installed_library_is_used_only_where_it_fits(
    tmp_path: Path, machine: dict, entry: dict, used: bool
) -> None:
    if "libraries" in machine:
        _fake_install(tmp_path, native.FUSED)
        (tmp_path / native.BUILD_INFO).write_text(json.dumps({**native.build_record({}), **machine}))
    else:
        _fake_install(tmp_path, native.FUSED, machine, **entry)
    found = native.installed(native.FUSED, openmp=True, where=tmp_path)
    assert (found == tmp_path / native.installed_name(native.FUSED)) is used
    assert native.installed(native.FUSED, openmp=True, where=tmp_path / "nowhere") is None


def test_an_openmp_build_needs_torchs_libgomp(tmp_path: Path) -> None:
    _fake_install(tmp_path, native.FUSED)  # recorded as built with OpenMP
    assert native.installed(native.FUSED, openmp=True, where=tmp_path) is not None
    assert native.installed(native.FUSED, openmp=False, where=tmp_path) is None
    _fake_install(tmp_path, native.FUSED, openmp=False)  # single-threaded: runs under either
    assert native.installed(native.FUSED, openmp=True, where=tmp_path) is not None

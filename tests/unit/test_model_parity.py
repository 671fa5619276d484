"""The torch paged, batched engine against the numpy reference, on the tiny synthetic model.

Tolerance: logits agree with the float64 reference to atol 1e-4 in float32 (observed ~1e-6;
logits have std ~1, so 1e-4 is loose enough for any BLAS and tight enough to catch a wrong
position, mask or head mapping, which move logits by O(0.1)). Greedy tokens must be equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from kvfleet_common.kv_blocks import OutOfBlocks
from kvfleet_models.config import LlamaConfig, tiny_config
from kvfleet_models.reference import reference_generate, reference_logits
from kvfleet_models.tiny import tiny_weights
from tests.unit.model_configs import GQA_CFG
from worker_svc.engine import DecodeItem, Engine, EngineConfig, ItemStatus, PrefillItem, SamplingSpec, sample_token
from worker_svc.local import LocalSteps

ATOL = 1e-4
GREEDY = SamplingSpec()
CFG = tiny_config()
WEIGHTS = tiny_weights(CFG)
GQA_WEIGHTS = tiny_weights(GQA_CFG, seed=1)


def _prompt(n: int, salt: int) -> list[int]:
    return [(7 * i + 3 * salt + 1) % CFG.vocab_size for i in range(n)]


@dataclass
class Plan:
    prompt: list[int]
    join: int  # step at which the first chunk is sent
    chunks: list[int]  # prefill chunk sizes, summing to len(prompt)
    new_tokens: int
    sampling: SamplingSpec = GREEDY
    idle: tuple[int, ...] = ()  # steps at which the session sends nothing
    # Filled in by drive():
    sent_chunks: int = 0
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)


def _plans(new_tokens: int = 9) -> dict[str, Plan]:
    """Prompts of 1, 3, 4, 7, 17 tokens joining at different steps; the 17 in three chunks."""
    return {
        "a": Plan(_prompt(1, 0), 0, [1], new_tokens),
        "b": Plan(_prompt(3, 1), 0, [3], new_tokens),
        "c": Plan(_prompt(4, 2), 1, [4], new_tokens),
        "d": Plan(_prompt(7, 3), 3, [7], new_tokens),
        "e": Plan(_prompt(17, 4), 2, [6, 7, 4], new_tokens),
    }


def drive(engine: Engine, plans: dict[str, Plan], release_done: bool = False, mode_of_step=lambda step: None) -> None:
    """A minimal scheduler: every step, the next chunk or one decode for each live session
    (the blocks chosen by a ``LocalSteps``, as the scheduler would)."""
    steps = LocalSteps(engine)
    for step in range(100):
        prefill, decode = [], []
        for sid, p in plans.items():
            if step < p.join or step in p.idle or len(p.tokens) >= p.new_tokens:
                continue
            if p.sent_chunks < len(p.chunks):
                start = sum(p.chunks[: p.sent_chunks])
                chunk = tuple(p.prompt[start : start + p.chunks[p.sent_chunks]])
                prefill.append(PrefillItem(sid, chunk, start, p.sent_chunks == len(p.chunks) - 1, p.sampling))
                p.sent_chunks += 1
            else:
                decode.append(
                    DecodeItem(sid, p.tokens[-1], len(p.prompt) + len(p.tokens) - 1, p.sampling, len(p.tokens))
                )
        if not prefill and not decode:
            return
        out = steps.step(prefill, decode, return_logits=True, kv_views=mode_of_step(step))
        assert out.logits is not None
        for row, r in enumerate(out.results):
            assert r.status is ItemStatus.OK, r
            if r.token_id is not None:
                plans[r.session_id].tokens.append(r.token_id)
                plans[r.session_id].logits.append(out.logits[row])
        if release_done:
            steps.release(s for s, p in plans.items() if len(p.tokens) == p.new_tokens)
    raise AssertionError("the schedule did not finish")


def _check_against_reference(cfg: LlamaConfig, weights: dict[str, np.ndarray], plans: dict[str, Plan]) -> None:
    for sid, p in plans.items():
        assert p.tokens == reference_generate(cfg, weights, p.prompt, p.new_tokens), sid
        ref = reference_logits(cfg, weights, p.prompt + p.tokens[:-1])
        got = np.stack(p.logits)  # [new_tokens, V]
        np.testing.assert_allclose(got, ref[len(p.prompt) - 1 :], atol=ATOL, rtol=0, err_msg=sid)


def _engine(
    kv_views: str = "rebuild", cfg: LlamaConfig = CFG, weights: dict[str, np.ndarray] | None = None, **kw: object
) -> Engine:
    config = EngineConfig(
        block_size=4,
        num_blocks=kw.pop("num_blocks", 64),  # type: ignore[arg-type]
        kv_views=kv_views,
        **kw,
    )  # type: ignore[arg-type]
    return Engine(cfg, WEIGHTS if weights is None else weights, config)


@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
def test_mixed_batch_matches_reference(kv_views: str) -> None:
    plans = _plans()
    drive(_engine(kv_views), plans)
    _check_against_reference(CFG, WEIGHTS, plans)
    assert len({t for p in plans.values() for t in p.tokens}) > 5, "tiny model output degenerate"


@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
def test_gqa_matches_reference(kv_views: str) -> None:
    plans = _plans()
    drive(_engine(kv_views, GQA_CFG, GQA_WEIGHTS), plans)
    _check_against_reference(GQA_CFG, GQA_WEIGHTS, plans)


def test_chunked_prefill_equals_unchunked() -> None:
    prompt = _prompt(17, 9)
    chunked = {"s": Plan(prompt, 0, [5, 8, 4], 8)}
    whole = {"s": Plan(prompt, 0, [17], 8)}
    drive(_engine(), chunked)
    drive(_engine(), whole)
    assert chunked["s"].tokens == whole["s"].tokens
    np.testing.assert_allclose(np.stack(chunked["s"].logits), np.stack(whole["s"].logits), atol=ATOL, rtol=0)


def test_kv_views_modes_give_identical_tokens() -> None:
    # Releasing finished sessions mid-run moves persistent rows around (compaction), and idle
    # sessions make some steps' rows non-consecutive (a gather instead of a slice). Both modes
    # on the per-op path, whose primitives they share (rebuild's whole steps sum its products
    # in another order: the reference tests above hold them to ATOL).
    runs = {}
    for kv_views in ("rebuild", "persistent"):
        plans = _plans()
        plans["a"].new_tokens, plans["c"].new_tokens = 3, 5
        plans["b"].idle, plans["e"].idle = (4, 5), (9,)
        drive(_engine(kv_views, whole_steps=False), plans, release_done=True)
        runs[kv_views] = plans
    for sid in runs["rebuild"]:
        assert runs["rebuild"][sid].tokens == runs["persistent"][sid].tokens, sid
        np.testing.assert_allclose(
            np.stack(runs["rebuild"][sid].logits), np.stack(runs["persistent"][sid].logits), atol=1e-6, rtol=0
        )


@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
def test_cache_miss_is_per_item_and_changes_nothing(kv_views: str) -> None:
    engine = _engine(kv_views)
    steps = LocalSteps(engine)
    pa, pb = _prompt(5, 1), _prompt(3, 2)
    out = steps.step([PrefillItem("a", tuple(pa), 0, True, GREEDY), PrefillItem("b", tuple(pb), 0, True, GREEDY)], [])
    ta, tb = (r.token_id for r in out.results)
    used = engine.stats().used_blocks
    out = steps.step(
        [
            PrefillItem("a", (1, 2), 0, True, GREEDY),  # a exists: start 0 is a miss
            PrefillItem("zz", (1, 2), 4, True, GREEDY),
        ],  # unknown session, start > 0
        [
            DecodeItem("b", tb, len(pb), GREEDY, 1),  # correct
            DecodeItem("ghost", 3, 0, GREEDY, 0),
        ],
    )  # unknown session
    assert [r.status for r in out.results] == [
        ItemStatus.CACHE_MISS,
        ItemStatus.CACHE_MISS,
        ItemStatus.OK,
        ItemStatus.CACHE_MISS,
    ]
    assert out.results[0].kv_tokens == len(pa) and out.results[0].token_id is None
    assert out.results[2].token_id == reference_generate(CFG, WEIGHTS, pb, 2)[1]
    out = steps.step(
        [],
        [
            DecodeItem("a", ta, len(pa) + 1, GREEDY, 1),  # wrong position
            DecodeItem("b", 5, len(pb) + 1, GREEDY, 2),
        ],
    )
    assert [r.status for r in out.results] == [ItemStatus.CACHE_MISS, ItemStatus.OK]
    assert engine.stats().cache_misses == 4
    assert engine.stats().used_blocks == used + 1 and not engine.views.holds("zz")
    assert steps.tables.allocator.num_used == used + 1 and sorted(engine.session_ids()) == ["a", "b"]
    # a was untouched by its misses: it continues exactly as the reference.
    out = steps.step([], [DecodeItem("a", ta, len(pa), GREEDY, 1)])
    assert out.results[0].token_id == reference_generate(CFG, WEIGHTS, pa, 2)[1]


@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
def test_out_of_blocks_refuses_the_step_without_partial_state(kv_views: str) -> None:
    # The block books are the driver's (the scheduler's): a step whose blocks do not fit is
    # refused before the engine sees it, and neither the books nor the engine change.
    engine = _engine(kv_views, num_blocks=4)  # 16 tokens of cache
    steps = LocalSteps(engine)
    out = steps.step(
        [
            PrefillItem("a", tuple(_prompt(6, 0)), 0, True, GREEDY),
            PrefillItem("c", tuple(_prompt(4, 2)), 0, True, GREEDY),
        ],
        [],
    )
    assert [r.status for r in out.results] == [ItemStatus.OK, ItemStatus.OK]
    ta, tc = (r.token_id for r in out.results)
    assert ta == reference_generate(CFG, WEIGHTS, _prompt(6, 0), 1)[0]
    before = engine.stats()
    assert (before.active_sessions, before.used_blocks, before.free_blocks) == (2, 3, 1)

    def unchanged() -> None:
        assert engine.stats() == before and sorted(engine.session_ids()) == ["a", "c"]
        assert (steps.tables.allocator.num_used, steps.tables.allocator.num_free) == (3, 1)
        assert sorted(steps.tables.session_ids()) == ["a", "c"]
        assert [len(steps.tables.blocks(s)) for s in ("a", "c")] == [2, 1]

    with pytest.raises(OutOfBlocks):  # a first chunk that does not fit: 3 blocks, 1 free
        steps.step([PrefillItem("big", tuple(_prompt(11, 1)), 0, True, GREEDY)], [])
    unchanged()
    assert not steps.tables.has("big") and not engine.views.holds("big")
    # a second chunk that does not fit leaves the sessions as they were and usable
    with pytest.raises(OutOfBlocks):
        steps.step([PrefillItem("c", tuple(_prompt(9, 3)), 4, False, GREEDY)], [DecodeItem("a", ta, 6, GREEDY, 1)])
    unchanged()
    out = steps.step([], [DecodeItem("a", ta, 6, GREEDY, 1), DecodeItem("c", tc, 4, GREEDY, 1)])
    assert [r.status for r in out.results] == [ItemStatus.OK, ItemStatus.OK]
    assert out.results[0].token_id == reference_generate(CFG, WEIGHTS, _prompt(6, 0), 2)[1]
    assert out.results[1].token_id == reference_generate(CFG, WEIGHTS, _prompt(4, 2), 2)[1]
    assert engine.stats().used_blocks == steps.tables.allocator.num_used == 4


@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
def test_release_frees_blocks_and_session(kv_views: str) -> None:
    engine = _engine(kv_views)
    steps = LocalSteps(engine)
    total = engine.stats().free_blocks
    out = steps.step(
        [
            PrefillItem(s, tuple(_prompt(n, i)), 0, True, GREEDY)
            for i, (s, n) in enumerate([("a", 9), ("b", 2), ("c", 5)])
        ],
        [],
    )
    assert engine.stats().used_blocks == steps.tables.allocator.num_used == 3 + 1 + 2
    assert steps.release(["a", "nope", "a"]) == 1
    assert steps.release(["a"]) == 0
    assert engine.stats().used_blocks == steps.tables.allocator.num_used == 3
    assert engine.stats().active_sessions == 2
    assert not engine.views.holds("a")
    tb, tc = out.results[1].token_id, out.results[2].token_id
    out = steps.step(
        [PrefillItem("a", tuple(_prompt(4, 7)), 0, True, GREEDY)],
        [DecodeItem("b", tb, 2, GREEDY, 1), DecodeItem("c", tc, 5, GREEDY, 1)],
    )
    assert [r.token_id for r in out.results] == [
        reference_generate(CFG, WEIGHTS, _prompt(4, 7), 1)[0],
        reference_generate(CFG, WEIGHTS, _prompt(2, 1), 2)[1],
        reference_generate(CFG, WEIGHTS, _prompt(5, 2), 2)[1],
    ]
    assert steps.release(["a", "b", "c"]) == 3
    assert engine.stats().free_blocks == steps.tables.allocator.num_free == total


def test_seeded_sampling_is_a_function_of_seed_and_index() -> None:
    spec = SamplingSpec(temperature=1.5, top_k=20, top_p=0.95, seed=11)

    def run(spec: SamplingSpec, kv_views: str, others: int) -> list[int]:
        plans = {"s": Plan(_prompt(5, 0), 0, [5], 12, spec)}
        for i in range(others):  # different batch company
            plans[f"o{i}"] = Plan(_prompt(3 + i, i + 1), i, [3 + i], 4)
        drive(_engine(kv_views), plans)
        return plans["s"].tokens

    first = run(spec, "rebuild", 0)
    assert run(spec, "persistent", 3) == first
    others = [run(SamplingSpec(1.5, 20, 0.95, seed), "rebuild", 0) for seed in (1, 2, 3)]
    assert all(o != first for o in others)
    assert len(set(first)) > 3


def test_sample_token_filters() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 3.0])
    # ties -> lowest id for greedy, as numpy argmax
    assert sample_token(logits, GREEDY, 0) == int(np.argmax(logits.numpy())) == 1
    draws = {sample_token(logits, SamplingSpec(1.0, top_k=3, seed=s), i) for s in range(5) for i in range(20)}
    assert draws == {1, 2, 4}
    # p(1) = p(4) ~ 0.34: top_p 0.3 keeps only the first of the sorted pair, 0.5 keeps both.
    draws = {sample_token(logits, SamplingSpec(1.0, top_p=0.3, seed=s), i) for s in range(5) for i in range(20)}
    assert draws == {1}
    draws = {sample_token(logits, SamplingSpec(1.0, top_p=0.5, seed=s), i) for s in range(5) for i in range(20)}
    assert draws == {1, 4}
    assert sample_token(logits, SamplingSpec(0.7, seed=3), 9) == sample_token(
        logits.clone(), SamplingSpec(0.7, seed=3), 9
    )


def test_items_the_worker_cannot_run_are_rejected_alone_and_change_nothing() -> None:
    # Blocks enough to reach max_position: the driver hands out the blocks, and the engine
    # must be the one to refuse the decode past it.
    engine = _engine(num_blocks=CFG.max_position // 4 + 1)
    steps = LocalSteps(engine)
    ok = _prompt(3, 6)
    alone = steps.step([PrefillItem("ok", tuple(ok), 0, True, GREEDY)], []).results[0].token_id
    steps.release(["ok"])
    bad = [
        (PrefillItem("pos", (1,) * 3, CFG.max_position - 2, True, GREEDY), "max_position"),
        (PrefillItem("vocab", (1, CFG.vocab_size), 0, True, GREEDY), "outside vocab_size"),
        (PrefillItem("empty", (), 0, True, GREEDY), "empty"),
        (PrefillItem("bias", (1, 2), 0, True, SamplingSpec(logit_bias=((CFG.vocab_size, 5.0),))), "logit_bias"),
        (PrefillItem("grammar", (1, 2), 0, True, SamplingSpec(constraint="json_object")), "no grammar support"),
    ]
    out = steps.step([PrefillItem("ok", tuple(ok), 0, True, GREEDY)] + [item for item, _ in bad], [])
    good, *rejected = out.results
    assert good.status == ItemStatus.OK and good.token_id == alone  # the batch ran without them
    for r, (item, says) in zip(rejected, bad):
        assert (r.session_id, r.status, r.token_id, r.kv_tokens) == (item.session_id, ItemStatus.REJECTED, None, 0)
        assert says in r.error
    assert engine.stats().active_sessions == 1 and engine.stats().item_errors == len(bad)
    assert steps.tables.session_ids() == ["ok"] and steps.tables.allocator.num_used == 1
    # A decode past max_position is rejected too, and ends that session here (its KV freed).
    last = steps.step([], [DecodeItem("ok", good.token_id, CFG.max_position, GREEDY, 1)]).results[0]
    assert last.status == ItemStatus.REJECTED and "max_position" in last.error
    assert engine.stats().active_sessions == 0 and engine.stats().used_blocks == 0
    assert steps.tables.allocator.num_used == 0
    with pytest.raises(ValueError, match="more than once"):  # a malformed step is refused whole
        steps.step([PrefillItem("a", (1,), 0, True, GREEDY)], [DecodeItem("a", 1, 1, GREEDY, 0)])
    assert steps.tables.allocator.num_used == 0 and engine.session_ids() == []


@pytest.mark.parametrize(
    "kwargs", [{"device": "tpu"}, {"dtype": "float64"}, {"block_size": 0}, {"num_blocks": -1}, {"kv_views": "paged"}]
)
def test_engine_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SamplingSpec(top_p=0.0)


def test_engine_sizes() -> None:
    engine = _engine()
    assert engine.parameter_count == sum(w.size for w in WEIGHTS.values())
    assert engine.weight_bytes == 4 * engine.parameter_count
    assert engine.kv_bytes_per_token == 2 * CFG.num_layers * CFG.kv_dim * 4
    assert engine.capacity_tokens == 64 * 4 and engine.device == torch.device("cpu")
    assert EngineConfig(device="auto").device == "auto"


def test_bfloat16_runs_close_to_reference() -> None:
    steps = LocalSteps(_engine(dtype="bfloat16"))
    prompt = _prompt(7, 5)
    out = steps.step([PrefillItem("a", tuple(prompt), 0, True, GREEDY)], [], return_logits=True)
    assert out.logits is not None
    ref = reference_logits(CFG, WEIGHTS, prompt)[-1]
    assert np.abs(out.logits[0] - ref).max() < 0.25  # bf16 keeps ~3 significant digits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
def test_cuda_matches_reference(kv_views: str) -> None:
    plans = _plans()
    drive(_engine(kv_views, device="cuda"), plans)
    _check_against_reference(CFG, WEIGHTS, plans)


def test_switching_kv_views_per_step_keeps_tokens_exact() -> None:
    # An experiment may flip the lever between steps; persistent rows refill from the paged cache.
    plans = _plans()
    engine = _engine("rebuild")
    drive(engine, plans, release_done=True, mode_of_step=lambda step: ("rebuild", "persistent", "persistent")[step % 3])
    _check_against_reference(CFG, WEIGHTS, plans)


def test_unknown_kv_views_override_is_rejected() -> None:
    with pytest.raises(ValueError, match="kv_views"):
        LocalSteps(_engine()).step([PrefillItem("x", (1,), 0, True, GREEDY)], [], kv_views="sideways")

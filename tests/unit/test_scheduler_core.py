"""Table-driven tests of the scheduler core's tick rules (the README's scheduling rules; the reference figures are in tests/data/).

Every expected figure below was worked out by hand from the rules, not read off the code:
  * a tick admits waiting sessions FCFS (lower priority value first) while fewer than
    max_running run and the tick's prefill token budget has room; chunked prefills already under
    way take the budget first; the chunk that completes a prompt yields the first new token;
  * every session prefilled in an earlier tick decodes one token (the decode batch);
  * a session that reaches max_new_tokens finishes in the tick, and its KV is freed in the tick;
  * KV is counted at the tick's end, after frees (1536 bytes a token for the tiny model).
The worked derivations are in the comments next to each table.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest

from scheduler_svc.core import (
    AdmissionRejected,
    Dropped,
    FinishReason,
    NotSessionOwner,
    RejectReason,
    Sampling,
    SchedulerCore,
    SchedulerLimits,
    SessionRequest,
    StepResult,
    StepStatus,
    TickOutcome,
    TickPlan,
    WorkerSpec,
    WorkloadPolicy,
)
from scheduler_svc.core.session import Phase
from scheduler_svc.core.stats import WorkloadStats
from tests.unit.sim import (
    BPT,
    MAX_POSITION,
    VOCAB,
    FakeWorkers,
    complete_tick,
    fake_token,
    make_core,
    plan_tick,
    req,
    run_to_completion,
    tiny_worker,
)

# ---- helpers ------------------------------------------------------------------------------


def step(core: SchedulerCore, fake: FakeWorkers) -> tuple[TickPlan, TickOutcome]:
    plan, early = plan_tick(core)
    fake.release(early)
    if plan.empty:
        return plan, early
    out = complete_tick(core, plan, fake.run(plan), outcome=early)
    fake.release(out)
    return plan, out


def expected_tokens(session_id: str, n: int) -> list[int]:
    return [fake_token(session_id, i) for i in range(n)]


@dataclass(frozen=True)
class Tick:
    """One tick as observed: prefill chunks (session, start, length, last), decode batch,
    sessions that got a token, sessions finished, KV tokens held at the tick's end."""

    prefill: tuple[tuple[str, int, int, bool], ...] = ()
    decode: tuple[str, ...] = ()
    emitted: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()
    kv: int = 0


def T(p=(), d=(), f=(), kv=0) -> Tick:
    """Expected tick. A token comes from each prompt-completing chunk and each decode."""
    p = tuple(tuple(x) for x in p)
    emitted = tuple(sorted([x[0] for x in p if x[3]] + list(d)))
    return Tick(prefill=p, decode=tuple(sorted(d)), emitted=emitted, finished=tuple(sorted(f)), kv=kv)


def observe(core: SchedulerCore, fake: FakeWorkers, plan: TickPlan, out: TickOutcome) -> Tick:
    snap = core.snapshot()
    assert snap.kv_total_bytes == sum(fake.kv.values()) * BPT, "scheduler and worker disagree on KV"
    return Tick(
        prefill=tuple((p.session_id, p.start_position, len(p.token_ids), p.last_chunk) for p in plan.prefill),
        decode=tuple(sorted(d.session_id for d in plan.decode)),
        emitted=tuple(sorted(sid for sid, _ in out.tokens)),
        finished=tuple(sorted(sid for sid, _ in out.finished)),
        kv=snap.kv_total_bytes // BPT,
    )


def trace(core: SchedulerCore, fake: FakeWorkers, max_ticks: int = 500) -> list[Tick]:
    ticks = []
    while core.has_work():
        plan, out = step(core, fake)
        assert not plan.empty, "the scheduler has work but planned nothing"
        ticks.append(observe(core, fake, plan, out))
        assert len(ticks) < max_ticks
    return ticks


# ---- 1. the reference concurrency sweep ---------------------------------------------------

# 8 sessions x prompt 4 x 8 new tokens, prefill budget 4 (one whole prompt a tick), so at most
# one admission a tick; a session admitted in tick a prefills (token 1) and decodes in a+1..a+7,
# finishing in a+7 and freeing its slot for an admission in a+8. Its KV at the end of tick
# a+k (k < 7) is 4+k tokens.
#   c=1: admitted 1,9,...,57 -> 64 ticks; 56 batches of 1; peak 10 tokens = 15360.
#   c=2: admitted 1,2 | 9,10 | 17,18 | 25,26 -> last finishes 33; ticks 2..33 decode (32
#        batches, 56/32 = 1.75); peak at tick 7: 10+9 = 19 tokens = 29184.
#   c=4: admitted 1-4 | 9-12 -> last finishes 19; batches in ticks 2..19 (18, 56/18 = 3.1111);
#        peak at tick 7: 10+9+8+7 = 34 tokens = 52224.
#   c=8: admitted 1-8 -> last finishes 15; batches 2..15 (14, 56/14 = 4.0); tick 8 decodes s0..s6
#        (7); peak 10+9+...+4 = 49 tokens = 75264 (ticks 7 and 8).
#   tokens_per_tick = (32 + 56) / ticks.
SWEEP = {
    1: dict(
        ticks=64, decode_batches=56, avg=1.0, max_occ=1, peak=15360, tpt=1.375, admitted=[1, 9, 17, 25, 33, 41, 49, 57]
    ),
    2: dict(
        ticks=33, decode_batches=32, avg=1.75, max_occ=2, peak=29184, tpt=2.6667, admitted=[1, 2, 9, 10, 17, 18, 25, 26]
    ),
    4: dict(
        ticks=19, decode_batches=18, avg=3.1111, max_occ=4, peak=52224, tpt=4.6316, admitted=[1, 2, 3, 4, 9, 10, 11, 12]
    ),
    8: dict(ticks=15, decode_batches=14, avg=4.0, max_occ=7, peak=75264, tpt=5.8667, admitted=[1, 2, 3, 4, 5, 6, 7, 8]),
}


def run_sweep(concurrency: int, snapshot_at_tick: int = 0, clock=None, on_tick=None):
    core = make_core(clock=clock)
    fake = FakeWorkers()
    wid, sids = core.submit_workload(
        [req(4, 8) for _ in range(8)],
        WorkloadPolicy(max_running=concurrency, prefill_token_budget=4, snapshot_at_tick=snapshot_at_tick),
    )
    run_to_completion(core, fake, on_tick=on_tick)
    return core, fake, wid, sids


@pytest.mark.parametrize("concurrency", sorted(SWEEP))
def test_sweep_matches_reference_results(concurrency):
    e = SWEEP[concurrency]
    core, fake, wid, sids = run_sweep(concurrency)
    stats = core.workload_stats(wid)
    assert stats is not None
    got = replace(
        stats, avg_batch_occupancy=round(stats.avg_batch_occupancy, 4), tokens_per_tick=round(stats.tokens_per_tick, 4)
    )
    assert got == WorkloadStats(
        sessions=8,
        ticks=e["ticks"],
        decode_batches=e["decode_batches"],
        decode_tokens=56,
        prefill_tokens=32,
        avg_batch_occupancy=e["avg"],
        max_batch_occupancy=e["max_occ"],
        peak_kv_bytes=e["peak"],
        tokens_per_tick=e["tpt"],
        rejected_admissions=0,
        cache_misses=0,
    )
    assert [core.session(s).admitted_tick for s in sids] == e["admitted"]
    for sid in sids:
        s = core.session(sid)
        assert s.finish_reason == FinishReason.LENGTH
        assert s.generated == expected_tokens(sid, 8)
    assert fake.kv == {}
    assert all(w.reserved_tokens == 0 for w in core.workers)


# ---- 2. hand-worked tick tables -----------------------------------------------------------

WP = WorkloadPolicy
# A case: (limits, workers, groups, expected ticks). A group is (policy, [(prompt, max_new[,
# priority])...]); policy None means plain submit() calls. Session ids are issued in order s0, s1...
BLOCK1_CAP1000 = (tiny_worker("w0", blocks=1000, block_size=1),)
BLOCK1_CAP20 = (tiny_worker("w0", blocks=20, block_size=1),)
TINY = (tiny_worker(),)

TICK_CASES = {
    # Prompt 10, budget 4: chunks 4, 4, 2; the third completes the prompt and yields token 1;
    # two decodes give tokens 2 and 3; KV 4, 8, 10, 11, then freed.
    "chunked_prefill_10_by_4": (
        dict(prefill_token_budget=4),
        TINY,
        [(None, [(10, 3)])],
        [
            T(p=[("s0", 0, 4, False)], kv=4),
            T(p=[("s0", 4, 4, False)], kv=8),
            T(p=[("s0", 8, 2, True)], kv=10),
            T(d=["s0"], kv=11),
            T(d=["s0"], f=["s0"], kv=0),
        ],
    ),
    # s0 (3) leaves 1 token of budget: s1 is admitted with a 1-token chunk. Tick 2: s1's prefill
    # under way takes 4, s0 decodes its 2nd token and finishes (4 tokens freed): KV = s1's 5.
    "two_sessions_share_budget": (
        dict(prefill_token_budget=4),
        TINY,
        [(None, [(3, 2), (5, 2)])],
        [
            T(p=[("s0", 0, 3, True), ("s1", 0, 1, False)], kv=4),
            T(p=[("s1", 1, 4, True)], d=["s0"], f=["s0"], kv=5),
            T(d=["s1"], f=["s1"], kv=0),
        ],
    ),
    # A chunk under way eats the whole budget: s1 waits though a slot is free.
    "chunk_under_way_before_admission": (
        dict(prefill_token_budget=4),
        TINY,
        [(None, [(6, 1), (2, 1)])],
        [T(p=[("s0", 0, 4, False)], kv=4), T(p=[("s0", 4, 2, True), ("s1", 0, 2, True)], f=["s0", "s1"], kv=0)],
    ),
    # max_new_tokens=1: the prefill's token is the last; finished and freed in the same tick.
    "max_new_1_finishes_in_prefill_tick": (
        dict(prefill_token_budget=4),
        TINY,
        [(None, [(4, 1), (4, 1)])],
        [T(p=[("s0", 0, 4, True)], f=["s0"], kv=0), T(p=[("s1", 0, 4, True)], f=["s1"], kv=0)],
    ),
    # KV counted after frees: in tick 2 s0 finishes, so the tick ends with s1's 5 tokens, not
    # 5 + 5; the peak is tick 1's 8.
    "kv_counted_after_frees": (
        dict(prefill_token_budget=8),
        TINY,
        [(None, [(4, 2), (4, 4)])],
        [
            T(p=[("s0", 0, 4, True), ("s1", 0, 4, True)], kv=8),
            T(d=["s0", "s1"], f=["s0"], kv=5),
            T(d=["s1"], kv=6),
            T(d=["s1"], f=["s1"], kv=0),
        ],
    ),
    # A session part-way through its prefill counts against max_running.
    "prefilling_session_holds_a_slot": (
        dict(max_running=1, prefill_token_budget=4),
        TINY,
        [(None, [(10, 1), (2, 1)])],
        [
            T(p=[("s0", 0, 4, False)], kv=4),
            T(p=[("s0", 4, 4, False)], kv=8),
            T(p=[("s0", 8, 2, True)], f=["s0"], kv=0),
            T(p=[("s1", 0, 2, True)], f=["s1"], kv=0),
        ],
    ),
    # Global cap 2; workload A (s0-s2) capped at 1, workload B (s3, s4) uncapped. Tick 1: s0,
    # A is then full so s1, s2 are skipped without blocking B, s3 fills the global cap.
    "global_cap_vs_workload_cap": (
        dict(max_running=2),
        TINY,
        [(WP(max_running=1), [(2, 2)] * 3), (WP(), [(2, 2)] * 2)],
        [
            T(p=[("s0", 0, 2, True), ("s3", 0, 2, True)], kv=4),
            T(d=["s0", "s3"], f=["s0", "s3"], kv=0),
            T(p=[("s1", 0, 2, True), ("s4", 0, 2, True)], kv=4),
            T(d=["s1", "s4"], f=["s1", "s4"], kv=0),
            T(p=[("s2", 0, 2, True)], kv=2),
            T(d=["s2"], f=["s2"], kv=0),
        ],
    ),
    # Global cap 3; A (s0-s2) and B (s3, s4) capped at 2 each. Tick 1: s0, s1 (A full), s3;
    # the global cap then stops s4 even though B has room.
    "global_cap_binds_before_workload_cap": (
        dict(max_running=3),
        TINY,
        [(WP(max_running=2), [(2, 2)] * 3), (WP(max_running=2), [(2, 2)] * 2)],
        [
            T(p=[("s0", 0, 2, True), ("s1", 0, 2, True), ("s3", 0, 2, True)], kv=6),
            T(d=["s0", "s1", "s3"], f=["s0", "s1", "s3"], kv=0),
            T(p=[("s2", 0, 2, True), ("s4", 0, 2, True)], kv=4),
            T(d=["s2", "s4"], f=["s2", "s4"], kv=0),
        ],
    ),
    # Global budget 6; workload A's own budget is 2: s0 gets 2, s1 (B) the remaining 4.
    "workload_prefill_budget": (
        dict(prefill_token_budget=6),
        TINY,
        [(WP(prefill_token_budget=2), [(3, 1)]), (WP(), [(5, 1)])],
        [
            T(p=[("s0", 0, 2, False), ("s1", 0, 4, False)], kv=6),
            T(p=[("s0", 2, 1, True), ("s1", 4, 1, True)], f=["s0", "s1"], kv=0),
        ],
    ),
    # Priorities 5, 0, 5, -1 (lower first, FCFS among equals): s3, s1, s0, s2.
    "priority_one_slot": (
        dict(max_running=1),
        TINY,
        [(None, [(1, 1, 5), (1, 1, 0), (1, 1, 5), (1, 1, -1)])],
        [
            T(p=[("s3", 0, 1, True)], f=["s3"]),
            T(p=[("s1", 0, 1, True)], f=["s1"]),
            T(p=[("s0", 0, 1, True)], f=["s0"]),
            T(p=[("s2", 0, 1, True)], f=["s2"]),
        ],
    ),
    "priority_order_within_a_tick": (
        dict(prefill_token_budget=3),
        TINY,
        [(None, [(1, 1, 5), (1, 1, 0), (1, 1, 5), (1, 1, -1)])],
        [
            T(p=[("s3", 0, 1, True), ("s1", 0, 1, True), ("s0", 0, 1, True)], f=["s3", "s1", "s0"]),
            T(p=[("s2", 0, 1, True)], f=["s2"]),
        ],
    ),
    # KV budget 20 tokens (block 1). s0 reserves 4+10-1 = 13; s1 needs 11 (13+11 > 20) and heads
    # the queue, so s2 (needs 2, would fit) waits behind it: strict FCFS. s0 finishes in tick 10
    # (token 1 in tick 1, tokens 2-10 in ticks 2-10); s1 and s2 are admitted in tick 11; s2
    # finishes in 12; s1 (8 tokens) in 18.
    "strict_fcfs_kv_budget": (
        dict(kv_budget_bytes=20 * BPT),
        BLOCK1_CAP1000,
        [(None, [(4, 10), (4, 8), (1, 2)])],
        [T(p=[("s0", 0, 4, True)], kv=4)]
        + [T(d=["s0"], kv=4 + k) for k in range(1, 9)]
        + [
            T(d=["s0"], f=["s0"], kv=0),
            T(p=[("s1", 0, 4, True), ("s2", 0, 1, True)], kv=5),
            T(d=["s1", "s2"], f=["s2"], kv=5),
        ]
        + [T(d=["s1"], kv=k) for k in range(6, 11)]
        + [T(d=["s1"], f=["s1"], kv=0)],
    ),
}
# The same timeline when the limit is the worker's cache (20 tokens) instead of the KV budget.
TICK_CASES["strict_fcfs_worker_capacity"] = (
    dict(),
    BLOCK1_CAP20,
    TICK_CASES["strict_fcfs_kv_budget"][2],
    TICK_CASES["strict_fcfs_kv_budget"][3],
)
# Reservations are rounded up to whole blocks: worker of 2 blocks of 8; each session's worst
# case is 4+2-1 = 5 tokens -> one block. Two fit; the third (15 <= 16 unrounded) must wait.
TICK_CASES["reservations_round_to_blocks"] = (
    dict(),
    (tiny_worker("w0", blocks=2, block_size=8),),
    [(None, [(4, 2)] * 3)],
    [
        T(p=[("s0", 0, 4, True), ("s1", 0, 4, True)], kv=8),
        T(d=["s0", "s1"], f=["s0", "s1"], kv=0),
        T(p=[("s2", 0, 4, True)], kv=4),
        T(d=["s2"], f=["s2"], kv=0),
    ],
)


def submit_groups(core: SchedulerCore, groups) -> tuple[list[str], list[str]]:
    sids, wids = [], []
    for policy, specs in groups:
        reqs = [req(*spec) for spec in specs]
        if policy is None:
            sids += [core.submit(r) for r in reqs]
        else:
            wid, ids = core.submit_workload(reqs, policy)
            wids.append(wid)
            sids += ids
    return sids, wids


@pytest.mark.parametrize("name", sorted(TICK_CASES))
def test_tick_table(name):
    limits, workers, groups, expected = TICK_CASES[name]
    core, fake = make_core(workers, **limits), FakeWorkers()
    sids, wids = submit_groups(core, groups)
    got = trace(core, fake)
    for i, (g, e) in enumerate(zip(got, expected), start=1):
        assert g == e, f"tick {i}"
    assert len(got) == len(expected)
    # Every session ran to its length with the worker's tokens, nothing is left reserved or held.
    for sid in sids:
        s = core.session(sid)
        assert s.finish_reason == FinishReason.LENGTH
        assert s.generated == expected_tokens(sid, s.request.max_new_tokens)
    assert fake.kv == {}
    assert all(w.reserved_tokens == 0 for w in core.workers)
    assert core.counters.peak_kv_bytes == max(t.kv for t in expected) * BPT
    assert core.snapshot().ticks == len(expected)
    for wid in wids:
        assert core.workload_stats(wid) is not None


def test_chunked_prefill_work_items_and_first_token_tick():
    core, fake = make_core(prefill_token_budget=4), FakeWorkers()
    sid = core.submit(SessionRequest(prompt_ids=tuple(range(1, 11)), max_new_tokens=3))
    chunks, outs = [], []
    for _ in range(3):
        plan, out = step(core, fake)
        (p,) = plan.prefill
        chunks.append((p.token_ids, p.start_position, p.last_chunk, p.generated_so_far))
        outs.append(out.tokens)
    assert chunks == [((1, 2, 3, 4), 0, False, 0), ((5, 6, 7, 8), 4, False, 0), ((9, 10), 8, True, 0)]
    assert outs == [[], [], [(sid, fake_token(sid, 0))]]
    plan, _ = step(core, fake)
    (d,) = plan.decode
    assert (d.token_id, d.position, d.generated_so_far) == (fake_token(sid, 0), 10, 1)


def test_max_new_1_releases_kv_in_its_prefill_tick():
    core, fake = make_core(prefill_token_budget=4), FakeWorkers()
    sid = core.submit(req(4, 1))
    plan, early = plan_tick(core)
    assert core.workers.get("w0").reserved_tokens == 16  # 4 tokens, one block of 16
    out = complete_tick(core, plan, fake.run(plan), outcome=early)
    fake.release(out)
    assert out.release == {"w0": [sid]}
    assert out.finished == [(sid, FinishReason.LENGTH)]
    assert out.tokens == [(sid, fake_token(sid, 0))]
    assert core.workers.get("w0").reserved_tokens == 0
    assert core.snapshot().kv_total_bytes == 0 and core.counters.peak_kv_bytes == 0
    assert not core.has_work()


# ---- 3. admission rejections --------------------------------------------------------------


def _bad(**kw) -> SessionRequest:
    base = dict(prompt_ids=(1, 2, 3), max_new_tokens=4)
    base.update(kw)
    return SessionRequest(**base)


# (limits, workers, max_position, request, reason, words the message must hold)
REJECTIONS = {
    "kv_budget_bytes": (
        dict(kv_budget_bytes=10 * BPT),
        TINY,
        MAX_POSITION,
        req(4, 8),
        RejectReason.KV_BUDGET,
        ["11 tokens", "lower max_new_tokens", "shorten the prompt"],
    ),
    "kv_worker_capacity": (
        dict(),
        (tiny_worker(blocks=1, block_size=16),),
        MAX_POSITION,
        req(10, 8),
        RejectReason.KV_BUDGET,
        ["17 tokens", "lower max_new_tokens"],
    ),
    "prompt_over_max_prompt_tokens": (
        dict(max_prompt_tokens=8),
        TINY,
        MAX_POSITION,
        req(9, 1),
        RejectReason.PROMPT_TOO_LONG,
        ["9 tokens", "limit is 8"],
    ),
    "prompt_over_max_position": (
        dict(),
        TINY,
        16,
        req(10, 7),
        RejectReason.PROMPT_TOO_LONG,
        ["17", "16", "shorten the prompt or lower max_new_tokens"],
    ),
    "empty_prompt": (
        dict(),
        TINY,
        MAX_POSITION,
        _bad(prompt_ids=()),
        RejectReason.INVALID_REQUEST,
        ["empty", "at least one token"],
    ),
    "max_new_0": (
        dict(),
        TINY,
        MAX_POSITION,
        _bad(max_new_tokens=0),
        RejectReason.INVALID_REQUEST,
        ["max_new_tokens", "at least 1"],
    ),
    "max_new_over_limit": (
        dict(max_new_tokens=16),
        TINY,
        MAX_POSITION,
        _bad(max_new_tokens=17),
        RejectReason.INVALID_REQUEST,
        ["max_new_tokens", "17", "16"],
    ),
    "token_over_vocab": (
        dict(),
        TINY,
        MAX_POSITION,
        _bad(prompt_ids=(1, VOCAB, 2)),
        RejectReason.INVALID_REQUEST,
        ["48", "vocabulary", "0..47"],
    ),
    "token_negative": (
        dict(),
        TINY,
        MAX_POSITION,
        _bad(prompt_ids=(-1,)),
        RejectReason.INVALID_REQUEST,
        ["-1", "vocabulary"],
    ),
    "temperature_negative": (
        dict(),
        TINY,
        MAX_POSITION,
        _bad(sampling=Sampling(temperature=-0.5)),
        RejectReason.INVALID_REQUEST,
        ["temperature", "[0, 2]"],  # the range every layer applies (kvfleet_common.sampling_rules)
    ),
    "temperature_nan": (
        dict(),
        TINY,
        MAX_POSITION,
        _bad(sampling=Sampling(temperature=float("nan"))),
        RejectReason.INVALID_REQUEST,
        ["temperature"],
    ),
    "top_p_0": (
        dict(),
        TINY,
        MAX_POSITION,
        _bad(sampling=Sampling(top_p=0.0)),
        RejectReason.INVALID_REQUEST,
        ["top_p", "(0, 1]"],
    ),
    "top_p_over_1": (
        dict(),
        TINY,
        MAX_POSITION,
        _bad(sampling=Sampling(top_p=1.5)),
        RejectReason.INVALID_REQUEST,
        ["top_p", "(0, 1]"],
    ),
    "top_k_negative": (
        dict(),
        TINY,
        MAX_POSITION,
        _bad(sampling=Sampling(top_k=-1)),
        RejectReason.INVALID_REQUEST,
        ["top_k", "0..4294967295"],
    ),
    "no_worker": (dict(), (), MAX_POSITION, req(4, 4), RejectReason.NO_WORKER, ["no live worker", "retry"]),
}


@pytest.mark.parametrize("name", sorted(REJECTIONS))
def test_rejection(name):
    limits, workers, max_position, request, reason, words = REJECTIONS[name]
    core = make_core(workers, max_position=max_position, **limits)
    with pytest.raises(AdmissionRejected) as info:
        core.submit(request)
    assert info.value.reason == reason
    for w in words:
        assert w in info.value.message
    snap = core.snapshot()
    assert snap.rejected_by_reason == {reason.value: 1}
    assert snap.rejected_admissions_total == 1
    assert snap.queue_depth == 0 and not core.has_work()


# The boundary just inside each limit is accepted.
ACCEPTED_AT_LIMIT = {
    "kv_budget_exact": (dict(kv_budget_bytes=16 * BPT), TINY, MAX_POSITION, req(4, 8)),
    "prompt_at_max_prompt_tokens": (dict(max_prompt_tokens=8), TINY, MAX_POSITION, req(8, 1)),
    "prompt_plus_new_at_max_position": (dict(), TINY, 16, req(10, 6)),
    "max_new_at_limit": (dict(max_new_tokens=16), TINY, MAX_POSITION, req(3, 16)),
    "top_p_1_temperature_0": (dict(), TINY, MAX_POSITION, _bad(sampling=Sampling(temperature=0.0, top_p=1.0))),
    "token_47": (dict(), TINY, MAX_POSITION, _bad(prompt_ids=(0, VOCAB - 1))),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED_AT_LIMIT))
def test_accepted_at_limit(name):
    limits, workers, max_position, request = ACCEPTED_AT_LIMIT[name]
    core, fake = make_core(workers, max_position=max_position, **limits), FakeWorkers()
    sid = core.submit(request)
    run_to_completion(core, fake)
    assert core.session(sid).finish_reason == FinishReason.LENGTH
    assert core.snapshot().rejected_admissions_total == 0


def test_queue_full_single_and_workload():
    core = make_core(max_queue_depth=2)
    core.submit(req(2, 2))
    core.submit(req(2, 2))
    with pytest.raises(AdmissionRejected) as info:
        core.submit(req(2, 2))
    assert info.value.reason == RejectReason.QUEUE_FULL
    assert "2 of 2" in info.value.message and "retry later or send fewer" in info.value.message
    assert core.queue_depth == 2
    # A workload that would overflow the queue is refused whole.
    core2 = make_core(max_queue_depth=3)
    core2.submit(req(2, 2))
    with pytest.raises(AdmissionRejected) as info:
        core2.submit_workload([req(2, 2)] * 3)
    assert info.value.reason == RejectReason.QUEUE_FULL
    assert "cannot take 3 more" in info.value.message
    assert core2.queue_depth == 1
    assert core.snapshot().rejected_by_reason == {"queue_full": 1}
    assert core2.snapshot().rejected_by_reason == {"queue_full": 1}


def test_no_worker_after_the_only_worker_failed():
    core = make_core()
    core.worker_failed("w0")
    with pytest.raises(AdmissionRejected) as info:
        core.submit(req(2, 2))
    assert info.value.reason == RejectReason.NO_WORKER
    assert core.snapshot().rejected_by_reason == {"no_worker": 1}


@pytest.mark.parametrize(
    "policy, words",
    [
        (WP(max_running=5), ["max_running", "5", "1..4"]),
        (WP(max_running=-1), ["max_running", "1..4"]),
        (WP(prefill_token_budget=513), ["prefill_token_budget", "513", "1..512"]),
    ],
)
def test_workload_policy_above_scheduler_limit(policy, words):
    core = make_core(max_running=4)
    with pytest.raises(AdmissionRejected) as info:
        core.submit_workload([req(2, 2)], policy)
    assert info.value.reason == RejectReason.INVALID_REQUEST
    for w in words:
        assert w in info.value.message
    assert core.queue_depth == 0
    assert core.snapshot().rejected_by_reason == {"invalid_request": 1}


@pytest.mark.parametrize(
    "bad, reason, where",
    [
        (_bad(prompt_ids=(1, 99)), RejectReason.INVALID_REQUEST, "session 2: "),
        (req(4, 40), RejectReason.KV_BUDGET, "session 2: "),  # 43 tokens > 32-token worker
        (req(9, 1), RejectReason.PROMPT_TOO_LONG, "session 2: "),
    ],
)
def test_workload_is_atomic(bad, reason, where):
    core = make_core((tiny_worker(blocks=2, block_size=16),), max_prompt_tokens=8)
    with pytest.raises(AdmissionRejected) as info:
        core.submit_workload([req(2, 2), req(3, 2), bad, req(2, 2)])
    assert info.value.reason == reason
    assert info.value.message.startswith(where)
    assert core.queue_depth == 0 and not core.has_work()
    assert core.snapshot().rejected_by_reason == {reason.value: 1}  # one rejection, not four
    # The scheduler is untouched: a good workload afterwards runs normally.
    fake = FakeWorkers()
    wid, sids = core.submit_workload([req(2, 2)])
    run_to_completion(core, fake)
    assert core.workload_stats(wid).ticks == 2
    assert core.session(sids[0]).finish_reason == FinishReason.LENGTH


def test_empty_workload_rejected():
    core = make_core()
    with pytest.raises(AdmissionRejected) as info:
        core.submit_workload([])
    assert info.value.reason == RejectReason.INVALID_REQUEST
    assert "at least one session" in info.value.message


def test_by_default_the_workers_caches_are_the_kv_budget():
    """No budget configured (0, the default): the scheduler caps nothing of its own. A session
    needing more than 64 MiB (the old default, 5 SmolLM2 sessions of 256 tokens) but within a
    worker's cache is admitted; one past every worker's cache is refused, the message naming the
    caches, not a budget; the snapshot's budget is the live workers' caches together."""
    big = WorkerSpec("w0", capacity_tokens=2048, block_size=16, kv_bytes_per_token=46080)  # SmolLM2, float32
    other = WorkerSpec("w1", capacity_tokens=1024, block_size=16, kv_bytes_per_token=46080)
    core = make_core((big, other), max_position=8192, max_prompt_tokens=4096)
    assert SchedulerLimits().kv_budget_bytes == 0
    sid = core.submit(req(1300, 256))  # 1,555 tokens: 71.7 MB of KV
    plan, _ = plan_tick(core)
    assert sid in [p.session_id for p in plan.prefill]
    snap = core.snapshot()
    assert snap.kv_budget_bytes == (2048 + 1024) * 46080
    assert snap.kv_reserved_bytes == 1568 * 46080  # 98 blocks of 16
    with pytest.raises(AdmissionRejected) as info:
        core.submit(req(1900, 256))  # 2,155 tokens: more than either worker holds
    assert info.value.reason == RejectReason.KV_BUDGET
    assert "more than any worker's cache holds" in info.value.message and "budget (" not in info.value.message
    # The same request under the old 64 MiB budget is refused, the message naming the budget.
    capped = make_core((big,), max_position=8192, max_prompt_tokens=4096, kv_budget_bytes=64 * 1024 * 1024)
    with pytest.raises(AdmissionRejected) as info:
        capped.submit(req(1300, 256))
    assert "the KV budget (67108864 bytes)" in info.value.message
    assert capped.snapshot().kv_budget_bytes == 64 * 1024 * 1024
    # No live worker: no budget, and the pressure is 0, not a division by zero.
    core.worker_failed("w0")
    core.worker_failed("w1")
    assert (core.snapshot().kv_budget_bytes, core.snapshot().kv_pressure) == (0, 0.0)


def test_kv_budget_bytes_may_be_zero_but_not_negative():
    assert SchedulerLimits(kv_budget_bytes=0).kv_budget_bytes == 0
    with pytest.raises(ValueError, match="kv_budget_bytes must be 0"):
        SchedulerLimits(kv_budget_bytes=-1)


def test_session_whose_block_rounded_reservation_exceeds_kv_budget_is_rejected():
    # Worst case 4 + 10 - 1 = 13 tokens, within a 13-token budget, but KV is reserved in whole
    # blocks of 16 (KvReservations.could_ever_fit rounds up), and 16 tokens are over: rejected
    # at submit rather than queued for ever.
    core = make_core(kv_budget_bytes=13 * BPT)  # block 16
    with pytest.raises(AdmissionRejected) as info:
        core.submit(req(4, 10))
    assert info.value.reason == RejectReason.KV_BUDGET
    assert "needs up to 13 tokens of KV" in info.value.message
    assert core.queue_depth == 0 and not core.has_work()
    assert core.snapshot().rejected_by_reason == {"kv_budget": 1}
    # One whole block of budget takes the same request, admits it at once and runs it to the end.
    core, fake = make_core(kv_budget_bytes=16 * BPT), FakeWorkers()
    sid = core.submit(req(4, 10))
    plan, _ = plan_tick(core)
    assert [p.session_id for p in plan.prefill] == [sid]
    complete_tick(core, plan, fake.run(plan))
    run_to_completion(core, fake)
    assert core.session(sid).finish_reason == FinishReason.LENGTH


# ---- 4. invariants on random workloads ----------------------------------------------------


def _random_setup(rng: random.Random):
    workers = []
    for i in range(rng.randint(1, 3)):
        block = rng.choice([1, 2, 4, 8])
        workers.append(tiny_worker(f"w{i}", blocks=rng.randint(24, 48) // block, block_size=block))
    # Any budget: admission and validation both use block-rounded footprints.
    limits = dict(
        max_running=rng.randint(1, 6),
        prefill_token_budget=rng.randint(1, 16),
        kv_budget_bytes=rng.randint(16, 64) * BPT,
        max_queue_depth=1000,
    )
    return tuple(workers), limits


def _check_tick(
    core: SchedulerCore, fake: FakeWorkers, plan: TickPlan, limits: dict, caps: dict[str, WorkloadPolicy]
) -> None:
    # The plan: one item per session, within max_running and the prefill budget(s).
    sids = [p.session_id for p in plan.prefill] + [d.session_id for d in plan.decode]
    assert len(sids) == len(set(sids))
    assert len(plan.decode) <= limits["max_running"]
    assert len(sids) <= limits["max_running"]
    assert sum(len(p.token_ids) - p.cached_tokens for p in plan.prefill) <= limits["prefill_token_budget"]
    for wid, pol in caps.items():
        mine = [s for s in sids if core.session(s).workload_id == wid]
        if pol.max_running:
            assert len(mine) <= pol.max_running
        if pol.prefill_token_budget:
            assert (
                sum(
                    len(p.token_ids) - p.cached_tokens
                    for p in plan.prefill
                    if core.session(p.session_id).workload_id == wid
                )
                <= pol.prefill_token_budget
            )
    # The books at the tick's end.
    assert core.running_count <= limits["max_running"]
    snap = core.snapshot()
    assert snap.kv_reserved_bytes <= limits["kv_budget_bytes"]
    # Held KV counts a shared prefix once per session; reservations count its blocks once.
    assert snap.kv_total_bytes <= sum(core.workers.reserved(s) for w in core.workers for s in w.sessions) * BPT
    assert snap.kv_total_bytes == sum(fake.kv.values()) * BPT
    for slot in core.workers:
        wid = slot.spec.worker_id
        assert 0 <= slot.reserved_tokens <= slot.spec.capacity_tokens
        on_it = [core.session(s) for s in slot.sessions]
        # A block shared by sessions of one prefix is reserved once.
        held_blocks = {b for s in on_it for b in slot.tables.blocks(s.session_id)}
        assert slot.reserved_tokens == len(held_blocks) * slot.spec.block_size
        assert slot.reserved_tokens <= sum(core.workers.reserved(s.session_id) for s in on_it)
        assert all(s.running and s.worker_id == wid for s in on_it)
        assert fake.held_on(wid) <= sum(core.workers.reserved(s.session_id) for s in on_it)
        if not slot.live:
            assert fake.held_on(wid) == 0 and slot.reserved_tokens == 0
    for sid, held in fake.kv.items():
        s = core.session(sid)
        assert s.running and s.worker_id == fake.owner[sid]
        assert held == s.kv_tokens <= core.workers.reserved(sid)


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_keep_invariants(seed):
    rng = random.Random(seed)
    workers, limits = _random_setup(rng)
    core, fake = make_core(workers, **limits), FakeWorkers()
    arrivals = sorted((rng.choice([0, 0, rng.randint(0, 40)]), k) for k in range(rng.randint(3, 12)))
    accepted: list[str] = []
    caps: dict[str, WorkloadPolicy] = {}
    cancelled: dict[str, int] = {}  # session -> tokens it had when cancelled
    emitted = 0
    down: dict[str, int] = {}  # failed worker -> iteration it comes back
    for it in range(5000):
        while arrivals and arrivals[0][0] <= it:
            arrivals.pop(0)
            reqs = [req(rng.randint(1, 12), rng.randint(1, 10)) for _ in range(rng.randint(1, 4))]
            before = core.queue_depth
            try:
                if rng.random() < 0.5:
                    pol = WP(
                        max_running=rng.choice([None, rng.randint(1, limits["max_running"])]),
                        prefill_token_budget=rng.choice([None, rng.randint(1, limits["prefill_token_budget"])]),
                    )
                    wid, ids = core.submit_workload(reqs, pol)
                    caps[wid] = pol
                else:
                    ids = [core.submit(reqs[0])]
                accepted += ids
            except AdmissionRejected as e:
                assert e.reason == RejectReason.KV_BUDGET
                assert core.queue_depth == before
        for wid, back in list(down.items()):
            if it >= back:
                core.worker_recovered(core.workers.get(wid).spec, VOCAB, MAX_POSITION)
                del down[wid]
        live = [s for s in accepted if core.session(s).phase != Phase.FINISHED]
        if live and rng.random() < 0.15:
            sid = rng.choice(live)
            cancelled[sid] = len(core.session(sid).generated)
            depth = core.queue_depth
            if core.cancel(sid)[0] == "queued":  # gone from the queue at once
                assert core.session(sid).phase == Phase.FINISHED
                assert core.queue_depth == depth - 1
        if not core.has_work():
            if not arrivals:
                break
            continue
        plan, early = plan_tick(core)
        fake.release(early)
        emitted += len(early.tokens)
        if plan.empty:  # only cancellations this tick, or queued work waiting for a dead worker
            assert down or not core.has_work(), "the scheduler has work but planned nothing"
            continue
        failed: frozenset[str] = frozenset()
        live_workers = [w.spec.worker_id for w in core.workers.live]
        if not down and len(live_workers) > 1 and rng.random() < 0.05:
            failed = frozenset([rng.choice(live_workers)])
        results = fake.run(plan)
        for wid in failed:
            for sid in fake.drop_worker(wid):
                results.pop(sid, None)
            down[wid] = it + rng.randint(1, 5)
        out = complete_tick(core, plan, results, failed_workers=failed, outcome=early)
        fake.release(out)
        emitted += len(out.tokens)
        _check_tick(core, fake, plan, limits, caps)
    else:
        pytest.fail("the run did not terminate")
    # Everything admitted finished; nothing is reserved or held anywhere.
    assert core.queue_depth == 0 and core.running_count == 0
    assert all(w.reserved_tokens == 0 and not w.sessions for w in core.workers)
    assert fake.kv == {}
    assert core.snapshot().kv_reserved_bytes == 0 and core.snapshot().kv_total_bytes == 0
    total = 0
    for sid in accepted:
        s = core.session(sid)
        total += len(s.generated)
        full = expected_tokens(sid, s.request.max_new_tokens)
        if sid in cancelled:
            assert s.finish_reason == FinishReason.CANCELLED
            assert len(s.generated) == cancelled[sid]
            assert s.generated == full[: len(s.generated)]
        else:
            assert s.finish_reason == FinishReason.LENGTH
            assert s.generated == full
    # Recomputes re-emit nothing: every token streamed out is a generated token, once.
    assert emitted == total
    for wid in caps:
        assert core.workload_stats(wid) is not None


# ---- 5. cancellation and worker failure ---------------------------------------------------


def test_cancel_queued_session_leaves_queue_at_once():
    core, fake = make_core(max_running=1), FakeWorkers()
    s0, s1 = core.submit(req(4, 4)), core.submit(req(4, 4))
    step(core, fake)  # s0 admitted, s1 waits
    assert core.queue_depth == 1
    assert core.cancel(s1)[0] == "queued"
    assert core.queue_depth == 0
    assert core.session(s1).finish_reason == FinishReason.CANCELLED
    assert core.snapshot().completed_sessions == 1
    plans = []
    run_to_completion(core, fake, on_tick=lambda plan, out: plans.append(plan))
    assert all(s1 not in {w.session_id for w in p.prefill + p.decode} for p in plans)
    assert core.session(s1).generated == []
    assert core.session(s0).finish_reason == FinishReason.LENGTH


def test_cancel_running_session_released_at_next_plan_tick():
    core, fake = make_core(prefill_token_budget=8), FakeWorkers()
    s0, s1 = core.submit(req(4, 6)), core.submit(req(4, 6))
    step(core, fake)
    step(core, fake)  # both hold 5 tokens, 2 generated
    assert core.cancel(s0)[0] == "decode"
    # Nothing changes until the next tick is planned.
    assert core.running_count == 2 and core.workers.get("w0").reserved_tokens == 32
    plan, early = plan_tick(core)
    assert early.release == {"w0": [s0]}
    assert early.finished == [(s0, FinishReason.CANCELLED)]
    assert [d.session_id for d in plan.decode] == [s1] and not plan.prefill
    assert core.workers.get("w0").reserved_tokens == 16
    fake.release(early)
    assert s0 not in fake.kv
    out = complete_tick(core, plan, fake.run(plan), outcome=early)
    fake.release(out)
    run_to_completion(core, fake)
    assert core.session(s0).generated == expected_tokens(s0, 2)
    assert core.session(s1).generated == expected_tokens(s1, 6)
    assert core.session(s1).finish_reason == FinishReason.LENGTH
    assert fake.kv == {} and core.workers.get("w0").reserved_tokens == 0


def test_cancel_during_chunked_prefill_and_last_session_empties_plan():
    core, fake = make_core(prefill_token_budget=4), FakeWorkers()
    wid, (sid,) = core.submit_workload([req(10, 3)])
    step(core, fake)
    assert core.cancel(sid)[0] == "prefill"
    plan, early = plan_tick(core)
    assert plan.empty and early.release == {"w0": [sid]}
    fake.release(early)
    assert not core.has_work() and fake.kv == {}
    stats = core.workload_stats(wid)
    assert stats is not None and stats.ticks == 1 and stats.prefill_tokens == 4
    with pytest.raises(KeyError):
        core.cancel("s999")


@pytest.mark.parametrize("fault", ["worker_failure", "cache_miss"])
def test_cancel_survives_requeue(fault):
    core, fake = make_core((tiny_worker("w0"), tiny_worker("w1"))), FakeWorkers()
    sid = core.submit(req(3, 6))
    step(core, fake)
    plan, early = plan_tick(core)  # tick 2 under way on w0 ...
    assert core.cancel(sid)[0] == "decode"  # ... when the client cancels
    if fault == "worker_failure":
        fake.drop_worker("w0")
        out = complete_tick(core, plan, {}, failed_workers={"w0"}, outcome=early)
    else:
        fake.lose(sid)
        out = complete_tick(core, plan, fake.run(plan), outcome=early)
    fake.release(out)
    run_to_completion(core, fake)
    assert core.session(sid).finish_reason == FinishReason.CANCELLED


def test_kv_gauge_after_cancel_only_tick():
    # A tick whose only work is a cancellation plans nothing, yet frees KV: the live gauge must
    # not keep reporting the freed bytes (it once was only recounted in complete_tick).
    core, fake = make_core(), FakeWorkers()
    sid = core.submit(req(4, 6))
    step(core, fake)
    step(core, fake)
    assert core.snapshot().kv_total_bytes == 5 * BPT
    core.cancel(sid)
    plan, early = plan_tick(core)
    fake.release(early)
    assert plan.empty and fake.kv == {} and core.snapshot().kv_reserved_bytes == 0
    snap = core.snapshot()
    assert (snap.kv_total_bytes, snap.kv_pressure) == (0, 0.0)


def _fault_free_tokens(specs) -> dict[str, list[int]]:
    core, fake = make_core((tiny_worker("w0"), tiny_worker("w1"))), FakeWorkers()
    sids = [core.submit(r) for r in specs]
    run_to_completion(core, fake)
    return {s: core.session(s).generated for s in sids}


def test_worker_failure_recomputes_on_the_other_worker():
    specs = [req(3, 6), req(3, 6)]
    core, fake = make_core((tiny_worker("w0"), tiny_worker("w1"))), FakeWorkers()
    s0, s1 = (core.submit(r) for r in specs)
    # Least-loaded placement, ties by id: s0 -> w0, then s1 -> w1.
    for _ in range(3):
        step(core, fake)  # 3 tokens each
    assert (core.session(s0).worker_id, core.session(s1).worker_id) == ("w0", "w1")
    plan, early = plan_tick(core)  # tick 4: w0 dies during it
    results = fake.run(plan)
    fake.drop_worker("w0")
    results.pop(s0)
    out = complete_tick(core, plan, results, failed_workers={"w0"}, outcome=early)
    fake.release(out)
    assert out.requeued == [s0]
    assert out.tokens == [(s1, fake_token(s1, 3))]  # s0's tick-4 token is lost with w0
    assert core.session(s0).phase == Phase.QUEUED and core.session(s0).kv_tokens == 0
    assert core.workers.get("w0").reserved_tokens == 0 and not core.workers.get("w0").live
    # Tick 5: s0 recomputes on w1: prompt + its 3 generated tokens, sampling index 3.
    plan, out = step(core, fake)
    (p,) = plan.prefill
    assert p.worker_id == "w1" and p.session_id == s0
    assert p.token_ids == specs[0].prompt_ids + tuple(expected_tokens(s0, 3))
    assert (p.start_position, p.last_chunk, p.generated_so_far) == (0, True, 3)
    assert (s0, fake_token(s0, 3)) in out.tokens
    run_to_completion(core, fake)
    assert {s: core.session(s).generated for s in (s0, s1)} == _fault_free_tokens(specs)
    assert fake.kv == {} and all(w.reserved_tokens == 0 for w in core.workers)


@pytest.mark.parametrize("status, cause", [("rejected", "rejected"), ("failed", "failed")])
def test_an_item_error_ends_that_session_alone(status, cause):
    core, fake = make_core(), FakeWorkers()
    sids = [core.submit(req(3, 6)) for _ in range(3)]
    step(core, fake)
    step(core, fake)
    plan, early = plan_tick(core)
    results = fake.run(plan)
    bad = sids[1]
    results[bad] = StepResult(bad, StepStatus(status), None, 0, error="logit_bias token id 99 is outside")
    fake.lose(bad)  # the worker freed it
    out = complete_tick(core, plan, results, outcome=early)
    fake.release(out)
    assert [(d.session_id, d.cause.value) for d in out.dropped] == [(bad, cause)]
    assert "worker w0" in out.dropped[0].why and "logit_bias token id 99" in out.dropped[0].why
    assert bad not in out.requeued and core.session(bad).phase == Phase.FINISHED
    assert core.workers.get("w0").live  # the worker is not blamed
    run_to_completion(core, fake)
    others = [sids[0], sids[2]]
    assert {s: core.session(s).generated for s in others} == {s: expected_tokens(s, 6) for s in others}
    assert fake.kv == {} and core.workers.get("w0").reserved_tokens == 0


def test_a_failed_step_recomputes_its_sessions_on_a_worker_that_stays_live():
    core, fake = make_core((tiny_worker("w0"), tiny_worker("w1"))), FakeWorkers()
    s0, s1 = core.submit(req(3, 6)), core.submit(req(3, 6))  # s0 on w0, s1 on w1
    step(core, fake)
    plan, early = plan_tick(core)
    results = fake.run(plan)
    results.pop(s0)
    out = complete_tick(core, plan, results, outcome=early, failed_steps={"w0": "INTERNAL: device fault"})
    assert out.requeued == [s0] and out.release == {"w0": [s0]}  # freed where the step failed
    fake.release(out)
    assert core.workers.get("w0").live and core.session(s0).moves == 1
    run_to_completion(core, fake)
    assert core.session(s0).generated == expected_tokens(s0, 6)
    assert core.session(s1).generated == expected_tokens(s1, 6)


def test_a_session_that_keeps_failing_ends_after_max_moves():
    core, fake = make_core((tiny_worker("w0"), tiny_worker("w1")), max_moves=2), FakeWorkers()
    sid = core.submit(req(3, 20))
    other = core.submit(req(3, 6))
    failures = 0
    dropped: list[Dropped] = []
    while core.has_work() and failures < 10:
        plan, early = plan_tick(core)
        fake.release(early)
        results = fake.run(plan)
        work = [w for w in plan.prefill + plan.decode if w.session_id == sid]
        failed = {}
        if work:  # every step holding the session fails on whatever worker it is on
            failed = {work[0].worker_id: "INTERNAL: the forward faulted"}
            failures += 1
            for w in plan.prefill + plan.decode:
                if w.worker_id == work[0].worker_id:
                    results.pop(w.session_id, None)
                    fake.lose(w.session_id)
        out = complete_tick(core, plan, results, outcome=early, failed_steps=failed)
        fake.release(out)
        dropped += out.dropped
    assert failures == 3  # the first try and max_moves recomputes
    assert [(d.session_id, d.cause.value) for d in dropped] == [(sid, "unavailable")]
    assert "recomputed 2 times" in dropped[0].why and "max_moves is 2" in dropped[0].why
    run_to_completion(core, fake)
    assert core.session(other).generated == expected_tokens(other, 6)
    assert all(w.live for w in core.workers)


def test_sessions_of_a_dead_worker_move_at_most_max_moves_times():
    workers = (tiny_worker("w0"), tiny_worker("w1"), tiny_worker("w2"))
    core, fake = make_core(workers, max_moves=1), FakeWorkers()
    sid = core.submit(req(3, 20))
    step(core, fake)
    first = core.session(sid).worker_id
    out = core.worker_failed(first, "UNAVAILABLE: connection refused")
    assert out.requeued == [sid] and not out.dropped
    fake.drop_worker(first)
    step(core, fake)
    second = core.session(sid).worker_id
    assert second not in (None, first)
    out = core.worker_failed(second, "DEADLINE_EXCEEDED")
    assert out.requeued == [] and [d.session_id for d in out.dropped] == [sid]
    assert f"worker {second} failed (DEADLINE_EXCEEDED)" in out.dropped[0].why
    assert core.session(sid).phase == Phase.FINISHED and not core.has_work()


def test_worker_failure_recompute_is_chunked_under_the_budget():
    core, fake = make_core((tiny_worker("w0"), tiny_worker("w1")), prefill_token_budget=4), FakeWorkers()
    sid = core.submit(req(3, 6))
    for _ in range(3):
        step(core, fake)
    plan, early = plan_tick(core)
    fake.drop_worker("w0")
    complete_tick(core, plan, {}, failed_workers={"w0"}, outcome=early)
    context = req(3, 6).prompt_ids + tuple(expected_tokens(sid, 3))  # 6 tokens: chunks 4, 2
    chunks = []
    for _ in range(2):
        plan, _ = step(core, fake)
        (p,) = plan.prefill
        chunks.append((p.worker_id, p.token_ids, p.start_position, p.last_chunk, p.generated_so_far))
    assert chunks == [("w1", context[:4], 0, False, 3), ("w1", context[4:], 4, True, 3)]
    ticks = 6 + len(run_to_completion(core, fake))
    assert ticks == 8  # 4 + recompute 2 + decodes of tokens 5, 6
    assert core.session(sid).generated == expected_tokens(sid, 6)


def test_cache_miss_counts_and_recomputes():
    core, fake = make_core(prefill_token_budget=8), FakeWorkers()
    wid, (s0, s1) = core.submit_workload([req(4, 5), req(4, 5)])
    step(core, fake)
    step(core, fake)  # 2 tokens each, 5 KV tokens each
    fake.lose(s0)  # the worker no longer holds s0
    plan, out = step(core, fake)
    assert out.requeued == [s0] and out.release == {"w0": [s0]}
    assert out.tokens == [(s1, fake_token(s1, 2))]
    assert core.counters.cache_misses == 1 and core.snapshot().cache_misses_total == 1
    plan, out = step(core, fake)  # tick 4: recompute prompt + 2 tokens
    (p,) = plan.prefill
    assert p.token_ids == req(4, 5).prompt_ids + tuple(expected_tokens(s0, 2))
    assert (p.start_position, p.last_chunk, p.generated_so_far) == (0, True, 2)
    run_to_completion(core, fake)
    assert core.session(s0).generated == expected_tokens(s0, 5)
    assert core.session(s1).generated == expected_tokens(s1, 5)
    # s1: tokens in ticks 1-5; s0: 1, 2, miss, recompute (3), 4, 5 -> 6 ticks. Prefill 8 + 6;
    # decodes 2+1+1+2+1 = 7 over ticks 2-6; KV peak at tick 4: s0 6 + s1 7 = 13 tokens.
    assert core.workload_stats(wid) == WorkloadStats(
        sessions=2,
        ticks=6,
        decode_batches=5,
        decode_tokens=7,
        prefill_tokens=14,
        avg_batch_occupancy=1.4,
        max_batch_occupancy=2,
        peak_kv_bytes=13 * BPT,
        tokens_per_tick=3.5,
        rejected_admissions=0,
        cache_misses=1,
    )


# ---- 6. the live snapshot -----------------------------------------------------------------


def test_mid_run_snapshot_at_tick_6_of_concurrency_4():
    # c=4: s0-s3 admitted in ticks 1-4, none finished by tick 6 (s0 finishes in 8).
    # Decode batches: tick 2: 1, 3: 2, 4: 3, 5: 4, 6: 4 -> 14 tokens over 5 batches (avg 2.8).
    # KV at the end of tick 6: s0 4+5, s1 4+4, s2 4+3, s3 4+2 = 30 tokens.
    # Each reserves 4+8-1 = 11 tokens, one 16-token block.
    # The clock ticks 1 s per read: tick k runs from 2k-2 to 2k-1. At tick 6 (end 11) the 5 s
    # window holds ticks 4-6 (ends 7, 9, 11; span 6..11 = 5 s): prefill 4 (s3), decode 3+4+4.
    clock = iter(float(i) for i in range(10_000))
    held = {}
    # The reference example's KV budget (`kvfleet sweep` gives its scheduler the same).
    budget = 64 * 1024 * 1024
    core, fake = make_core(clock=lambda: next(clock), kv_budget_bytes=budget), FakeWorkers()

    def on_tick(plan, out):
        if plan.tick == 6:
            held["tokens"] = sum(fake.kv.values())
            held["live"] = core.snapshot()

    wid, sids = core.submit_workload(
        [req(4, 8) for _ in range(8)], WorkloadPolicy(max_running=4, prefill_token_budget=4, snapshot_at_tick=6)
    )
    run_to_completion(core, fake, on_tick=on_tick)
    snap = core.workload_snapshot(wid)
    assert held["tokens"] == 30
    assert snap.kv_total_bytes == 30 * BPT == 46080
    assert snap.kv_pressure == round(46080 / budget, 4) == 0.0007
    assert (snap.active_sessions, snap.queue_depth, snap.completed_sessions) == (4, 4, 0)
    assert (snap.prefill_tokens_total, snap.decode_tokens_total, snap.ticks) == (16, 14, 6)
    assert (snap.batch_occupancy_last, snap.batch_occupancy_max, snap.batch_occupancy_avg) == (4, 4, 2.8)
    assert (snap.scratch_budget_bytes, snap.scratch_used_bytes, snap.scratch_pressure) == (4, 4, 1.0)
    assert snap.kv_budget_bytes == budget and snap.kv_reserved_bytes == 4 * 16 * BPT
    assert snap.rejected_admissions_total == 0 and snap.rejected_by_reason == {}
    assert (snap.weight_bytes, snap.cache_misses_total, snap.live_workers) == (0, 0, 1)
    assert (snap.prefill_tokens_per_sec, snap.decode_tokens_per_sec) == (0.8, 2.2)
    # The scheduler-wide view at that moment agrees (this is the only workload).
    live = held["live"]
    assert (
        live.active_sessions,
        live.queue_depth,
        live.prefill_tokens_total,
        live.decode_tokens_total,
        live.kv_total_bytes,
        live.ticks,
    ) == (4, 4, 16, 14, 46080, 6)
    assert (live.scratch_budget_bytes, live.scratch_used_bytes, live.scratch_pressure) == (4, 4, 1.0)
    # After the run the live view is empty again.
    end = core.snapshot()
    assert (end.active_sessions, end.queue_depth, end.completed_sessions) == (0, 0, 8)
    assert (end.kv_total_bytes, end.kv_reserved_bytes, end.ticks) == (0, 0, 19)


def test_rejections_by_reason_accumulate():
    core = make_core(max_queue_depth=1, max_prompt_tokens=8)
    core.submit(req(2, 2))
    for bad in (req(2, 2), req(2, 2), req(9, 1), _bad(max_new_tokens=0)):
        with pytest.raises(AdmissionRejected):
            core.submit(bad)
    snap = core.snapshot()
    # Validation comes before the queue check: the long prompt and max_new 0 are not queue_full.
    assert snap.rejected_by_reason == {"queue_full": 2, "prompt_too_long": 1, "invalid_request": 1}
    assert snap.rejected_admissions_total == 4


# ---- 7. ids, ownership, priority bounds, KV retries (hardening) --------------------------------


def test_service_ids_are_128_bit_random_and_never_repeat():
    a, b = SchedulerCore(SchedulerLimits()), SchedulerCore(SchedulerLimits())
    for core in (a, b):
        core.add_worker(tiny_worker(), VOCAB, MAX_POSITION)
    ids = [a.submit(req(2, 2)) for _ in range(3)] + [b.submit(req(2, 2)) for _ in range(3)]
    wid, wids = a.submit_workload([req(2, 2)])
    assert len(set(ids + wids + [wid])) == 8  # a restarted scheduler issues fresh ids too
    for sid in ids + wids:
        prefix, hex_part = sid.split("-")
        assert prefix == "s" and len(hex_part) == 32 and int(hex_part, 16) >= 0
    assert wid.startswith("w-") and len(wid) == 34


def test_only_the_owner_may_cancel():
    core, fake = make_core(), FakeWorkers()
    sid = core.submit(req(4, 4, owner="token:alice"))
    with pytest.raises(NotSessionOwner):
        core.cancel(sid, caller="token:mallory")
    with pytest.raises(NotSessionOwner):
        core.cancel(sid, caller="")
    assert core.session(sid).phase == Phase.QUEUED  # nothing changed
    state, out = core.cancel(sid, caller="token:alice")
    assert state == "queued" and out.finished == [(sid, FinishReason.CANCELLED)]
    assert not core.has_work() and not fake.kv


@pytest.mark.parametrize(
    "priority,ok", [(-10, True), (10, True), (0, True), (11, False), (-11, False), (2**31 - 1, False)]
)
def test_priority_is_bounded(priority, ok):
    core = make_core(max_running=1)
    if ok:
        first = core.submit(req(2, 2))  # priority 0, submitted first
        sid = core.submit(req(2, 2, priority=priority))
        assert core.session(sid).phase == Phase.QUEUED and core.session(sid).request.priority == priority
        assert core.queue_depth == 2 and core.snapshot().rejected_by_reason == {}
        # and the priority is honoured, not clamped or dropped: lower value first, FCFS among
        # equals, so only -10 overtakes the earlier priority-0 session for the one slot
        plan, _ = plan_tick(core)
        assert [p.session_id for p in plan.prefill] == [sid if priority < 0 else first]
        return
    with pytest.raises(AdmissionRejected) as e:
        core.submit(req(2, 2, priority=priority))
    assert e.value.reason == RejectReason.INVALID_REQUEST and "priority must be in -10..10" in e.value.message
    assert core.snapshot().rejected_by_reason == {"invalid_request": 1}


def test_a_session_its_worker_does_not_hold_is_recomputed_then_dropped_after_max_moves():
    # The worker loses s0 after every prefill (the books disagree: a bug). Each CACHE_MISS
    # recomputes it at once, as a failed step does, at most max_moves times; then it is dropped
    # with a reason, and another session on the same scheduler is not held up by it.
    core = make_core(max_moves=3, prefill_token_budget=64)
    fake = FakeWorkers()
    bad = core.submit(req(4, 6))
    good = core.submit(req(4, 6))
    admitted_at: list[int] = []
    dropped: list[Dropped] = []
    for tick in range(1, 100):
        if not core.has_work():
            break
        plan, out = step(core, fake)
        if any(p.session_id == bad for p in plan.prefill):
            admitted_at.append(tick)
        fake.lose(bad)  # whatever it prefilled is gone by the next step
        dropped += out.dropped
    # prefill at 1; its decode misses at 2 -> again at 3; misses at 4 -> 5; at 6 -> 7; the
    # fourth miss (tick 8) is one move too many.
    assert admitted_at == [1, 3, 5, 7]
    assert [d.session_id for d in dropped] == [bad]
    assert "did not hold its KV as the scheduler's books say (cache_miss)" in dropped[0][1]
    assert "recomputed 3 times" in dropped[0][1]
    assert core.session(bad).phase == Phase.FINISHED and core.session(bad).finish_reason is None
    assert core.session(good).generated == expected_tokens(good, 6)
    assert all(w.reserved_tokens == 0 for w in core.workers) and core.snapshot().queue_depth == 0


def test_a_stop_string_finish_is_settled_by_the_next_schedule_and_closes_its_workload():
    core, fake = make_core(), FakeWorkers()
    wid, (sid,) = core.submit_workload([req(4, 8)])
    step(core, fake)
    step(core, fake)
    in_flight, early = plan_tick(core)  # tick 3's decode is under way ...
    core.finish(sid, FinishReason.STOP)  # ... when the output processor sees a stop string
    out = complete_tick(core, in_flight, fake.run(in_flight), outcome=early)
    assert out.tokens == [] and core.session(sid).generated == expected_tokens(sid, 2)  # its token is not taken
    assert core.workload_stats(wid) is None and core.has_work()
    plan = core.schedule()
    assert plan.empty and plan.finished == ((sid, FinishReason.STOP),) and plan.release == {"w0": (sid,)}
    stats = core.workload_stats(wid)
    assert stats is not None and stats.sessions == 1 and not core.has_work()

"""Overlapped scheduling in the pure core: schedule() called while the last tick is still out
plans from the state that tick is expected to leave (issue 23 point 4). The oracle is the fake
worker's token function and its record of the token ids each session's KV holds: with overlap
the sessions must get exactly the tokens they get one tick at a time, and every KV must hold
exactly the session's prompt and generated tokens."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.core import FinishReason, SessionRequest, StepStatus, TickOutcome, TickPlan, WorkloadPolicy
from scheduler_svc.core.session import Phase
from scheduler_svc.core.types import AdmissionRejected
from tests.unit.sim import (
    BPT,
    VOCAB,
    FakeWorkers,
    fake_token,
    make_core,
    plan_tick,
    req,
    run_overlapped,
    run_to_completion,
    tiny_worker,
)


def _kv_matches(core, fake: FakeWorkers) -> None:
    """Every applied token of every running session is what its worker's KV holds."""
    for sid, held in fake.seq.items():
        s = core.session(sid)
        if not s.running or s.worker_id != fake.owner.get(sid):
            continue
        assert held[: s.kv_tokens] == s.tokens(0, s.kv_tokens), sid


def _expected(sid: str, n: int) -> list[int]:
    return [fake_token(sid, i) for i in range(n)]


def test_a_decode_planned_ahead_has_no_token_and_the_next_position():
    core, fake = make_core(), FakeWorkers()
    sid = core.submit(req(4, 5))
    first, _ = plan_tick(core)
    fake.run(first)
    # The prompt's last chunk is still out: the next tick decodes from where it will leave it.
    ahead, _ = plan_tick(core)
    (d,) = ahead.decode
    assert d.last_sampled and d.position == 4 and d.generated_so_far == 1
    # Applied one tick at a time, a decode names its token.
    core2, fake2 = make_core(), FakeWorkers()
    sid2 = core2.submit(req(4, 5))
    p, _ = plan_tick(core2)
    core2.update(p, fake2.run(p))
    nxt, _ = plan_tick(core2)
    (d2,) = nxt.decode
    assert not d2.last_sampled and d2.token_id == fake_token(sid2, 0) and d2.position == 4
    assert sid == sid2


def test_the_tick_that_gives_the_last_token_is_not_followed_by_another():
    """A session whose last token (max_new_tokens) is being sampled is not planned again."""
    core, fake = make_core(), FakeWorkers()
    core.submit(req(4, 2))
    p1, _ = plan_tick(core)
    r1 = fake.run(p1)
    p2, _ = plan_tick(core)  # decodes token 2 of 2
    assert len(p2.decode) == 1
    r2 = fake.run(p2)
    core.update(p1, r1)
    p3, _ = plan_tick(core)  # tick 2 is still out and gives the last token
    assert p3.empty
    out = core.update(p2, r2)
    assert [r for _, r in out.finished] == [FinishReason.LENGTH]


def test_a_session_ended_by_eos_one_tick_late_has_its_extra_token_discarded():
    core, fake = make_core(), FakeWorkers()
    sid = "s0"
    eos = fake_token(sid, 1)  # its second token ends it
    core.submit(req(4, 8, eos_token_ids=(eos,)))
    outs = run_overlapped(core, fake)
    s = core.session(sid)
    assert s.finish_reason == FinishReason.EOS and s.generated == _expected(sid, 2)
    tokens = [t for o in outs for _, t in o.tokens]
    assert tokens == _expected(sid, 2)  # the third token, sampled ahead, never left the core
    assert sum(1 for o in outs for f in o.finished) == 1
    assert fake.kv == {} and core.snapshot().kv_reserved_bytes == 0


def test_a_session_preempted_while_its_tick_is_out_ignores_that_tick():
    """Preempt mode: a decode that cannot grow preempts a session whose step is still out; the
    answer to that step is stale (the session's epoch moved on) and is not applied."""
    worker = tiny_worker(blocks=5, block_size=4)  # two sessions of 2 blocks each, then 3 each: full
    core, fake = make_core((worker,), kv_policy="preempt", kv_budget_bytes=20 * BPT, max_running=2), FakeWorkers()
    a = core.submit(req(4, 6))
    b = core.submit(req(4, 6))
    stale: list[str] = []

    def on_land(plan: TickPlan, out: TickOutcome) -> None:
        _kv_matches(core, fake)
        stale.extend(w.session_id for w in plan.prefill + plan.decode if w.epoch != core.session(w.session_id).epoch)

    run_overlapped(core, fake, on_land=on_land)
    assert core.preemptions >= 1 and stale, "the test must preempt a session with a step out"
    for sid in (a, b):
        s = core.session(sid)
        assert s.finish_reason == FinishReason.LENGTH and s.generated == _expected(sid, 6)
    assert fake.kv == {}


def test_cancel_and_stop_string_finishes_while_a_tick_is_out():
    core, fake = make_core(max_running=4), FakeWorkers()
    ids = [core.submit(req(3, 20)) for _ in range(3)]
    landed = 0

    def on_land(plan: TickPlan, out: TickOutcome) -> None:
        nonlocal landed
        landed += 1
        if landed == 4:
            core.cancel(ids[0])
            core.finish(ids[1], FinishReason.STOP)  # a stop string the output processor found

    outs = run_overlapped(core, fake, on_land=on_land)
    got = {sid: [t for o in outs for s, t in o.tokens if s == sid] for sid in ids}
    for sid in ids:
        s = core.session(sid)
        assert got[sid] == s.generated == _expected(sid, len(s.generated))
    assert core.session(ids[0]).finish_reason == FinishReason.CANCELLED
    assert core.session(ids[1]).finish_reason == FinishReason.STOP
    assert core.session(ids[2]).finish_reason == FinishReason.LENGTH and len(got[ids[2]]) == 20
    # Each is cut short: a token of the tick out when the finish came is not taken.
    assert len(got[ids[0]]) < 20 and len(got[ids[1]]) < 20
    assert fake.kv == {}


def test_overlap_plans_fewer_round_trips_of_idle_workers_not_fewer_tokens():
    """The same workload either way: every session gets the same tokens; with overlap each tick
    is planned before the last one landed."""

    def run(overlap: bool):
        core, fake = make_core(max_running=4, prefill_token_budget=8), FakeWorkers()
        _, ids = core.submit_workload([req(5, 7) for _ in range(6)], WorkloadPolicy())
        (run_overlapped if overlap else run_to_completion)(core, fake)
        return {sid: core.session(sid).generated for sid in ids}, fake

    plain, _ = run(False)
    ahead, fake = run(True)
    assert plain == ahead and all(len(g) == 7 for g in plain.values())
    assert fake.kv == {}


def _random_requests(rng: random.Random, n: int) -> list[SessionRequest]:
    out = []
    for _ in range(n):
        eos = tuple(rng.sample(range(VOCAB), rng.choice([0, 0, 1, 3])))
        out.append(req(rng.randint(1, 12), rng.randint(1, 10), eos_token_ids=eos))
    return out


@pytest.mark.parametrize("policy", ["reserve", "preempt"])
@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_give_the_same_tokens_with_overlap(seed, policy):
    """Random sizes, budgets, workers, EOS ids, cancels and item failures: each session's tokens
    are a prefix of its oracle's, end where its finish says, the KV always holds what was
    generated, nothing is emitted twice and every block comes back."""
    rng = random.Random(seed)
    workers = tuple(
        tiny_worker(f"w{i}", blocks=rng.randint(12, 40) // bs, block_size=bs)
        for i, bs in enumerate(rng.choice([1, 2, 4]) for _ in range(rng.randint(1, 3)))
    )
    core = make_core(
        workers,
        max_running=rng.randint(1, 6),
        prefill_token_budget=rng.randint(1, 16),
        kv_budget_bytes=rng.randint(16, 64) * BPT,
        kv_policy=policy,
        max_queue_depth=1000,
    )
    fake = FakeWorkers()
    ids: list[str] = []
    for r in _random_requests(rng, rng.randint(3, 12)):
        try:
            ids.append(core.submit(r))
        except AdmissionRejected:  # too large for this seed's workers: a refusal, not a failure
            continue
    assert ids, "every request was refused: nothing tested"
    cancelled: set[str] = set()
    failed_items: set[str] = set()
    real_run = fake.run

    def run_with_faults(plan: TickPlan):
        results = real_run(plan)
        for sid, r in list(results.items()):
            if r.status == StepStatus.OK and rng.random() < 0.02:
                fake.lose(sid)  # the worker freed it, as it does for a failed item
                results[sid] = type(r)(sid, StepStatus.FAILED, None, 0, error="injected")
                failed_items.add(sid)
        return results

    fake.run = run_with_faults  # type: ignore[method-assign]

    def on_land(plan: TickPlan, out: TickOutcome) -> None:
        _kv_matches(core, fake)
        live = [s for s in ids if core.session(s).phase != Phase.FINISHED]
        if live and rng.random() < 0.1:
            sid = rng.choice(live)
            core.cancel(sid)
            cancelled.add(sid)

    outs = run_overlapped(core, fake, on_land=on_land)
    emitted: dict[str, list[int]] = {}
    for o in outs:
        for sid, t in o.tokens:
            emitted.setdefault(sid, []).append(t)
    for sid in ids:
        s = core.session(sid)
        assert s.phase == Phase.FINISHED
        assert emitted.get(sid, []) == s.generated == _expected(sid, len(s.generated))
        eos_at = [i for i, t in enumerate(s.generated) if t in s.request.eos_token_ids]
        if s.finish_reason == FinishReason.EOS:
            assert eos_at == [len(s.generated) - 1]
        elif s.finish_reason == FinishReason.LENGTH:
            assert not eos_at and len(s.generated) == s.request.max_new_tokens
        elif s.finish_reason == FinishReason.CANCELLED:
            assert sid in cancelled and not eos_at
        else:
            assert s.finish_reason is None and sid in failed_items  # dropped with the item's error
    assert fake.kv == {}
    assert all(w.reserved_tokens == 0 and not w.sessions for w in core.workers)
    assert core.snapshot().kv_reserved_bytes == 0

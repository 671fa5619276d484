"""The scheduler core owns each worker's block tables: the plan carries every item's new block
ids, a prefix-cache hit is found (and reserved once) at placement, placement prefers the worker
holding the longest cached prefix, and a block is offered for sharing only once a step that
wrote it came back."""

from __future__ import annotations

import pytest

from scheduler_svc.core import SchedulerCore, SchedulerLimits, SessionRequest, StepResult, StepStatus
from tests.unit.sim import FakeWorkers, complete_tick, plan_tick, sequential_ids, settled, tiny_worker

BS = 4
SHARED = tuple(range(1, 13))  # three full blocks


def _core(workers=("w0",), blocks: int = 64, **limits) -> SchedulerCore:
    core = SchedulerCore(SchedulerLimits(**{"prefill_token_budget": 64, **limits}), new_id=sequential_ids())
    for w in workers:
        core.add_worker(tiny_worker(w, blocks=blocks, block_size=BS), vocab_size=48, max_position=512)
    return core


def _req(prompt, new: int = 3, owner: str = "") -> SessionRequest:
    return SessionRequest(prompt_ids=tuple(prompt), max_new_tokens=new, owner=owner)


class TablesSeen:
    """What a worker would build from the plans' deltas; checks every item fits its blocks."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def apply(self, plan) -> None:
        for p in plan.prefill:
            if p.start_position == 0:
                self.tables[p.session_id] = []
            self.tables[p.session_id] += p.block_ids
            assert len(self.tables[p.session_id]) * BS >= p.start_position + len(p.token_ids)
        for d in plan.decode:
            self.tables[d.session_id] += d.block_ids
            assert len(self.tables[d.session_id]) * BS >= d.position + 1


def _run(core: SchedulerCore, fake: FakeWorkers, seen: TablesSeen | None = None) -> list:
    plans = []
    while core.has_work():
        plan, early = plan_tick(core)
        fake.release(early)
        if plan.empty:
            continue
        if seen is not None:
            seen.apply(plan)
        plans.append(plan)
        fake.release(complete_tick(core, plan, fake.run(plan), outcome=early))
    return plans


def test_items_carry_their_new_blocks_once_and_tables_cover_every_token() -> None:
    core, fake, seen = _core(), FakeWorkers(), TablesSeen()
    a = core.submit(_req(range(1, 11), new=8))  # 10 + 8 - 1 = 17 tokens at most: 5 blocks
    plans = _run(core, fake, seen)
    first = plans[0].prefill[0]
    assert first.session_id == a and len(first.block_ids) == 5  # reserve policy: the worst case at once
    assert all(d.block_ids == () for p in plans[1:] for d in p.decode)  # nothing more to send
    assert len(set(seen.tables[a])) == 5


def test_preempt_policy_grows_block_by_block_and_sends_each_new_block_with_its_decode() -> None:
    core, fake, seen = _core(kv_policy="preempt"), FakeWorkers(), TablesSeen()
    a = core.submit(_req(range(1, 4), new=12))  # prompt 3 + first decode: 1 block at admission
    plans = _run(core, fake, seen)
    assert len(plans[0].prefill[0].block_ids) == 1
    grown = [(d.position, len(d.block_ids)) for p in plans[1:] for d in p.decode if d.block_ids]
    # A new block whenever the decode's position starts one: 4, 8, 12.
    assert grown == [(4, 1), (8, 1), (12, 1)]
    assert len(seen.tables[a]) == 4


def test_a_cached_prefix_is_found_at_placement_reserved_once_and_not_recomputed() -> None:
    core, fake = _core(), FakeWorkers()
    first = core.submit(_req(SHARED + (20, 21)))
    _run(core, fake)  # computed and finished: its full blocks stay cached (and free)
    reserved_free = core.snapshot().kv_reserved_bytes
    assert reserved_free == 0
    a = core.submit(_req(SHARED + (30, 31)))
    b = core.submit(_req(SHARED + (40,)))
    plan, early = plan_tick(core)
    chunks = {p.session_id: p for p in plan.prefill}
    assert chunks[a].cached_tokens == chunks[b].cached_tokens == 12
    # Both hold the same three prefix blocks: reserved once.
    ta, tb = core.workers.tables(a).blocks(a), core.workers.tables(b).blocks(b)
    assert ta[:3] == tb[:3] and not set(ta[3:]) & set(tb[3:])
    distinct = len(set(ta) | set(tb))
    assert core.snapshot().kv_reserved_bytes == distinct * BS * 1536 < (len(ta) + len(tb)) * BS * 1536
    complete_tick(core, plan, fake.run(plan), outcome=early)
    assert core.session(a).cached_tokens == 12 and core.session(first).cached_tokens == 0


def test_the_prefill_budget_is_spent_on_computed_tokens_only() -> None:
    core, fake = _core(prefill_token_budget=4), FakeWorkers()
    core.submit(_req(SHARED + (20,)))
    _run(core, fake)
    sid = core.submit(_req(SHARED + (30, 31, 32, 33, 34)))  # 12 cached + 5 to compute
    plan, _ = plan_tick(core)
    (chunk,) = plan.prefill
    assert (chunk.start_position, len(chunk.token_ids), chunk.cached_tokens) == (0, 16, 12)
    assert not chunk.last_chunk and chunk.session_id == sid


def test_blocks_are_shared_only_after_the_step_that_wrote_them_came_back() -> None:
    core, fake = _core(), FakeWorkers()
    a = core.submit(_req(SHARED + (20,)))
    b = core.submit(_req(SHARED + (30,)))
    plan, early = plan_tick(core)  # one step computes both: neither finds the other's blocks
    assert {p.session_id: p.cached_tokens for p in plan.prefill} == {a: 0, b: 0}
    complete_tick(core, plan, fake.run(plan), outcome=early)
    c = core.submit(_req(SHARED + (40,)))
    plan, early = plan_tick(core)
    assert {p.session_id: p.cached_tokens for p in plan.prefill} == {c: 12}  # now published
    # A step that failed names nothing: d's blocks are never offered.
    d = core.submit(_req((7,) * 12 + (1,)))
    complete_tick(core, plan, fake.run(plan), outcome=early)
    plan, early = plan_tick(core)
    results = fake.run(plan)
    results[d] = StepResult(d, StepStatus.CACHE_MISS, None, 0)
    complete_tick(core, plan, results, outcome=early)
    assert core.workers.get("w0").tables.cached_prefix((7,) * 12 + (2,)) == 0


@pytest.mark.parametrize("cache_aware", [True, False])
def test_placement_prefers_the_worker_holding_the_longest_cached_prefix(cache_aware: bool) -> None:
    """Off (--no-cache-aware-routing), the least loaded worker only; a session placed there
    still reuses what that worker holds."""
    core, fake = _core(("w0", "w1"), cache_aware_routing=cache_aware, pack_step_ms=0), FakeWorkers()
    warm = core.submit(_req(SHARED + (20,), new=2))
    _run(core, fake)
    assert core.workers.get("w0").tables.cached_prefix(SHARED + (1,)) == 12  # (w0: ties go by id)
    busy = core.submit(_req(range(1, 40), new=20))  # both empty again: w0 by id, and now loaded
    plan, early = plan_tick(core)
    fake.release(complete_tick(core, plan, fake.run(plan), outcome=early))
    assert core.session(busy).worker_id == "w0" and core.workers.get("w0").load > core.workers.get("w1").load
    hit = core.submit(_req(SHARED + (30,)))
    miss = core.submit(_req((9,) * 13))
    plan, early = plan_tick(core)
    placed = {p.session_id: (p.worker_id, p.cached_tokens) for p in plan.prefill}
    # Least loaded alone sends both to w1; the cached prefix keeps `hit` on w0.
    assert placed == ({hit: ("w0", 12), miss: ("w1", 0)} if cache_aware else {hit: ("w1", 0), miss: ("w1", 0)})
    assert core.session(warm).cached_tokens == 0


def _tick(core: SchedulerCore, fake: FakeWorkers, step_ms: dict[str, float] | None = None) -> None:
    """One tick, its workers' steps taking `step_ms` (what their answers would say)."""
    plan, early = plan_tick(core)
    fake.release(complete_tick(core, plan, fake.run(plan), outcome=early))
    core.steps_timed({w: round(ms * 1e6) for w, ms in (step_ms or {}).items()})


def test_a_worker_with_cheap_steps_takes_new_sessions_before_an_idle_one() -> None:
    """Packing (pack_step_ms): a worker whose steps took less than pack_step_ms takes the next
    session (the fullest such first), a worker with longer steps is placed on by load."""
    core, fake = _core(("w0", "w1", "w2"), pack_step_ms=2.0), FakeWorkers()
    a, b = core.submit(_req((1, 2, 3), new=20)), core.submit(_req((4, 2, 3), new=20))
    _tick(core, fake)  # no step timed yet: by load, as without packing
    assert (core.session(a).worker_id, core.session(b).worker_id) == ("w0", "w1")
    _tick(core, fake, {"w0": 0.5, "w1": 0.4})
    more = [core.submit(_req((k, 5, 6), new=20)) for k in range(10, 13)]
    _tick(core, fake, {"w0": 0.6, "w1": 0.5})
    # Both cheap and holding one each: the first by id takes all three (the fullest after one).
    assert [core.session(s).worker_id for s in more] == ["w0", "w0", "w0"]
    # w0's steps grew past the limit: w1 (cheap, fuller than the never-timed w2) is filled next.
    for _ in range(3):
        _tick(core, fake, {"w0": 9.0, "w1": 0.5})
    assert core.workers.get("w0").step_ms == 9.0
    later = core.submit(_req((20, 5, 6), new=20))
    _tick(core, fake)
    assert core.session(later).worker_id == "w1"
    # No worker cheap: the least loaded (w2, empty).
    for _ in range(6):
        _tick(core, fake, {"w1": 40.0})
    last = core.submit(_req((30, 1, 1), new=20))
    _tick(core, fake)
    assert core.session(last).worker_id == "w2"


def test_the_step_time_is_the_median_of_the_last_steps_and_a_restart_forgets_it() -> None:
    core = _core(("w0",), pack_step_ms=2.0)
    core.steps_timed({"w0": 1_000_000})
    assert core.workers.get("w0").step_ms == 1.0
    core.steps_timed({"w0": 50_000_000, "gone": 7})  # an unknown worker is ignored
    core.steps_timed({"w0": 1_200_000})
    assert core.workers.get("w0").step_ms == 1.2  # one slow step does not move it past the limit
    for _ in range(8):
        core.steps_timed({"w0": 3_000_000})
    assert core.workers.get("w0").step_ms == 3.0  # the last eight only
    core.worker_failed("w0")
    core.worker_recovered(tiny_worker("w0", blocks=64, block_size=BS), vocab_size=48, max_position=512)
    assert core.workers.get("w0").step_ms is None


def test_packing_stops_at_half_a_worker_s_kv() -> None:
    core, fake = _core(("w0", "w1"), blocks=16, pack_step_ms=2.0), FakeWorkers()
    first = core.submit(_req((1, 2, 3), new=25))  # 28 tokens: 7 of w0's 16 blocks
    _tick(core, fake, {"w0": 0.3, "w1": 0.3})
    second = core.submit(_req((4, 2, 3), new=5))  # w0 under half: packed there (9 of 16)
    _tick(core, fake)
    third = core.submit(_req((5, 2, 3), new=5))  # w0 past half: by load, to w1
    _tick(core, fake)
    assert [core.session(s).worker_id for s in (first, second, third)] == ["w0", "w0", "w1"]


def test_packing_off_spreads_even_cheap_steps() -> None:
    core, fake = _core(("w0", "w1"), pack_step_ms=0), FakeWorkers()
    core.submit(_req((9, 2, 3), new=20))
    _tick(core, fake, {"w0": 0.1, "w1": 0.1})
    ids = [core.submit(_req((k, 2, 3), new=20)) for k in range(3)]
    _tick(core, fake)
    assert [core.session(s).worker_id for s in ids] == ["w1", "w0", "w1"]


def test_a_cached_prefix_comes_before_packing() -> None:
    core, fake = _core(("w1",), pack_step_ms=2.0), FakeWorkers()
    core.submit(_req(SHARED + (20,), new=2))
    _run(core, fake)  # w1 holds SHARED's blocks and no session
    core.add_worker(tiny_worker("w0", blocks=64, block_size=BS), vocab_size=48, max_position=512)
    filler = core.submit(_req((9,) * 30, new=20))
    _tick(core, fake, {"w0": 0.2, "w1": 0.2})
    assert core.session(filler).worker_id == "w0"  # both empty: by id
    hit = core.submit(_req(SHARED + (30,)))  # packing alone would send it to w0, beside filler
    plan, _ = plan_tick(core)
    assert {(p.session_id, p.worker_id, p.cached_tokens) for p in plan.prefill} == {(hit, "w1", 12)}


@pytest.mark.parametrize("value", [-1, float("inf"), float("nan"), "2"])
def test_pack_step_ms_must_be_a_time(value) -> None:
    with pytest.raises(ValueError, match="pack_step_ms must be 0"):
        SchedulerLimits(pack_step_ms=value)


def test_callers_share_cached_blocks_only_with_themselves() -> None:
    core, fake = _core(), FakeWorkers()
    core.submit(_req(SHARED + (20,), owner="alice"))
    _run(core, fake)
    mine = core.submit(_req(SHARED + (30,), owner="alice"))
    theirs = core.submit(_req(SHARED + (30,), owner="bob"))
    anon = core.submit(_req(SHARED + (30,)))
    plan, _ = plan_tick(core)
    assert {p.session_id: p.cached_tokens for p in plan.prefill} == {mine: 12, theirs: 0, anon: 0}


def test_a_worker_taken_back_starts_with_empty_books() -> None:
    core, fake = _core(), FakeWorkers()
    core.submit(_req(SHARED + (20,)))
    _run(core, fake)
    assert core.workers.get("w0").tables.cached_prefix(SHARED + (1,)) == 12
    core.worker_failed("w0", "test")
    core.worker_recovered(core.workers.get("w0").spec, 48, 512)  # it may have restarted: its KV is gone
    slot = core.workers.get("w0")
    assert slot.live and slot.tables.cached_prefix(SHARED + (1,)) == 0 and slot.reserved_tokens == 0


def test_only_a_tick_that_places_copies_the_allocator(monkeypatch) -> None:
    """A tick is planned on a copy-on-write draft of the books; a copy of the allocator is
    O(num_blocks) (about 0.5 ms at the 100,000 blocks of a large GPU). Once a draft is the state,
    the results' writes (full blocks named, finished sessions' blocks freed) go in place: with
    the reserve policy only a tick that places sessions copies it."""
    from kvfleet_common import kv_blocks

    copies = []
    real_copy = kv_blocks.BlockAllocator.copy
    monkeypatch.setattr(kv_blocks.BlockAllocator, "copy", lambda self: copies.append(1) or real_copy(self))
    core, fake = _core(max_running=2), FakeWorkers()
    ids = [core.submit(_req(range(1 + k, 7 + k), new=12)) for k in range(4)]  # 6 + 12 tokens: 5 blocks each
    placing = 0
    while core.has_work():  # as the runtime drives it: one plan a tick (plan_tick plans twice)
        plan = core.plan()
        core.apply(plan)
        fake.release(settled(plan))
        placing += any(p.start_position == 0 for p in plan.prefill)
        if not plan.empty:
            fake.release(complete_tick(core, plan, fake.run(plan)))
    assert all(core.session(s).finish_reason is not None for s in ids)
    assert core.workers.get("w0").tables.allocator.num_used == 0
    # Two at a time: two placing ticks, over some 24 ticks that each name a full block or free one.
    assert placing == 2
    assert len(copies) == placing, (len(copies), placing)

"""The n choices of one request (a prefix group): the first computes the shared prompt, the rest
are admitted once its prefill is done, on its worker, so the worker's prefix cache serves them."""

from __future__ import annotations

from dataclasses import replace

from scheduler_svc.core import SchedulerCore, SessionRequest, WorkerSpec
from scheduler_svc.core.limits import SchedulerLimits
from tests.unit.sim import FakeWorkers, complete_tick, plan_tick, sequential_ids


def _core(workers: int = 2) -> SchedulerCore:
    core = SchedulerCore(SchedulerLimits(), new_id=sequential_ids())
    for i in range(workers):
        core.add_worker(WorkerSpec(f"w{i}", capacity_tokens=4096, block_size=16, kv_bytes_per_token=64), 48, 2048)
    return core


def _ticks(core: SchedulerCore, fake: FakeWorkers, n: int) -> list[list[tuple[str, str]]]:
    """Each tick's prefill items as (session, worker)."""
    seen = []
    for _ in range(n):
        plan, settled = plan_tick(core)
        seen.append([(p.session_id, p.worker_id) for p in plan.prefill])
        fake.release(complete_tick(core, plan, fake.run(plan), outcome=settled))
    return seen


def test_siblings_follow_the_first_prefill_on_its_worker():
    core, fake = _core(), FakeWorkers()
    req = SessionRequest(prompt_ids=tuple(range(1, 41)), max_new_tokens=4, prefix_group="g")
    ids = core.submit_group([req] * 3)
    ticks = _ticks(core, fake, 3)
    assert ticks[0] == [(ids[0], ticks[0][0][1])], "only the first choice computes the prompt"
    first_worker = ticks[0][0][1]
    assert sorted(ticks[1]) == sorted((sid, first_worker) for sid in ids[1:]), "then all the rest, beside it"
    assert ticks[2] == []


def test_without_a_group_the_same_requests_spread_and_start_together():
    core, fake = _core(), FakeWorkers()
    req = SessionRequest(prompt_ids=tuple(range(1, 41)), max_new_tokens=4)
    ids = core.submit_group([req] * 3)
    first = _ticks(core, fake, 1)[0]
    assert [sid for sid, _ in first] == ids
    assert len({w for _, w in first}) == 2, "least-loaded placement uses both workers"


def test_a_waiting_sibling_does_not_hold_back_other_sessions():
    core, fake = _core(workers=1), FakeWorkers()
    grouped = SessionRequest(prompt_ids=tuple(range(1, 41)), max_new_tokens=4, prefix_group="g")
    g = core.submit_group([grouped] * 2)
    other = core.submit(replace(grouped, prefix_group=""))
    first = [sid for sid, _ in _ticks(core, fake, 1)[0]]
    assert first == [g[0], other]


def test_groups_are_forgotten_with_their_sessions():
    core, fake = _core(), FakeWorkers()
    ids = core.submit_group([SessionRequest(prompt_ids=(1, 2, 3), max_new_tokens=1, prefix_group="g")] * 2)
    _ticks(core, fake, 3)
    for sid in ids:
        core.forget_session(sid)
    assert core._groups == {}

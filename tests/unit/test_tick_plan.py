"""The tick's plan is pure: `plan()` decides from the core's state and changes nothing; `apply()`
commits it, and only to the state it was planned from. (Every test that drives the core through
tests/unit/sim.py's `plan_tick` checks the first two on each tick as well.)"""

from __future__ import annotations

import ast
import pathlib

import pytest

from scheduler_svc.core import FinishReason, SchedulerCore, SchedulerLimits, SessionRequest, WorkerSpec
from tests.unit.sim import FakeWorkers, books, complete_tick, plan_tick, sequential_ids, tiny_worker

BPT = 1536
CORE = pathlib.Path(__file__).resolve().parents[2] / "scheduler_svc" / "core"


def _core(**limits) -> SchedulerCore:
    core = SchedulerCore(SchedulerLimits(**limits), clock=lambda: 1.0, new_id=sequential_ids())
    core.add_worker(tiny_worker(), 48, 2048)
    return core


def _req(prompt_len: int, max_new: int, **kw) -> SessionRequest:
    return SessionRequest(prompt_ids=tuple(1 + i % 47 for i in range(prompt_len)), max_new_tokens=max_new, **kw)


def test_planning_twice_gives_the_same_plan_and_changes_nothing():
    core, fake = _core(max_running=2, prefill_token_budget=6), FakeWorkers()
    a, b, c = (core.submit(_req(8, 4)) for _ in range(3))
    plan, _ = plan_tick(core)
    complete_tick(core, plan, fake.run(plan))  # a prefilled in part; b waits for budget
    core.cancel(b)  # queued: finished at once
    before = books(core)
    first, second = core.plan(), core.plan()
    assert first == second
    assert books(core) == before
    # What it decided: a's second chunk, then c admitted with the rest of the budget.
    assert [(p.session_id, p.start_position, len(p.token_ids)) for p in first.prefill] == [(a, 6, 2), (c, 0, 4)]
    assert first.admitted == (c,) and first.decode == ()
    assert core.session(c).worker_id is None and core.queued_ids() == [c]  # not admitted until applied
    core.apply(first)
    assert core.session(c).worker_id == "w0" and core.queued_ids() == []
    assert books(core) != before


def test_the_plan_carries_the_finishes_and_releases_it_settles():
    core, fake = _core(max_running=2), FakeWorkers()
    a = core.submit(_req(4, 8))
    plan, _ = plan_tick(core)
    complete_tick(core, plan, fake.run(plan))
    core.cancel(a)
    plan = core.plan()
    assert plan.finished == ((a, FinishReason.CANCELLED),) and plan.release == {"w0": (a,)}
    assert plan.empty and core.session(a).running  # settled only once applied
    core.apply(plan)
    assert core.session(a).finish_reason == FinishReason.CANCELLED and core.running_count == 0
    assert core.workers.get("w0").reserved_tokens == 0


def test_preemption_is_decided_in_the_plan_and_counted_when_applied():
    core = SchedulerCore(SchedulerLimits(kv_policy="preempt", max_running=4, prefill_token_budget=64))
    core.add_worker(WorkerSpec("w0", 8, 4, BPT), vocab_size=48, max_position=512)
    fake = FakeWorkers()
    first, second = core.submit(_req(3, 4)), core.submit(_req(3, 4, priority=1))
    for _ in range(2):  # both admitted (a block each: prompt and first decode), then one decode
        plan, _ = plan_tick(core)
        complete_tick(core, plan, fake.run(plan))
    plan = core.plan()  # each decode needs a second block now: the less urgent one gives way
    assert plan.requeued == (second,) and plan.release == {"w0": (second,)}
    assert core.preemptions == 0 and core.session(second).running
    core.apply(plan)
    assert core.preemptions == 1 and core.queued_ids() == [second]
    assert [d.session_id for d in plan.decode] == [first]


def test_a_plan_applies_only_to_the_state_it_was_planned_from():
    core = _core()
    core.submit(_req(4, 2))
    stale = core.plan()
    core.submit(_req(4, 2))  # the state changed since
    with pytest.raises(ValueError, match="stale"):
        core.apply(stale)
    plan = core.plan()
    core.apply(plan)
    with pytest.raises(ValueError, match="stale"):
        core.apply(plan)  # applied already


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name
    ]


def test_a_session_leaves_its_worker_in_one_place():
    """KV is released (and its worker told to forget the session) only by CoreState._leave_worker."""
    where = []
    for path in sorted(CORE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and (_calls(fn, "free") or _calls(fn, "release")):
                where.append(f"{path.name}:{fn.name}")
    # (kv_reservations.release frees the blocks in the books it keeps; plan.free names the session)
    assert sorted(where) == ["kv_reservations.py:release", "state.py:_leave_worker"]

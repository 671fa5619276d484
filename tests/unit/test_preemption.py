"""kv_policy="preempt": admission reserves only what a prompt needs; decode growth preempts the
least urgent, most recently admitted session, which is recomputed later with the same tokens."""

import random

import pytest

from scheduler_svc.core import (
    FinishReason,
    SchedulerCore,
    SchedulerLimits,
    SessionRequest,
    WorkerSpec,
)
from tests.unit.sim import FakeWorkers, complete_tick, fake_token, plan_tick

BPT = 1536


def _core(capacity_tokens: int, block: int = 4, workers: int = 1, **kw) -> SchedulerCore:
    limits = SchedulerLimits(kv_policy="preempt", **{"max_running": 8, "prefill_token_budget": 64, **kw})
    core = SchedulerCore(limits)
    for i in range(workers):
        core.add_worker(WorkerSpec(f"w{i}", capacity_tokens, block, BPT), vocab_size=48, max_position=512)
    return core


def _run(core: SchedulerCore, fake: FakeWorkers, capacity: int, on_tick=None) -> dict[str, FinishReason]:
    finished: dict[str, FinishReason] = {}
    for _ in range(5000):
        if not core.has_work():
            return finished
        plan, early = plan_tick(core)
        fake.release(early)
        finished.update(early.finished)
        if plan.empty:
            continue
        out = complete_tick(core, plan, fake.run(plan))
        fake.release(out)
        finished.update(out.finished)
        for w in core.workers:
            held = sum(n for sid, n in fake.kv.items() if fake.owner.get(sid) == w.spec.worker_id)
            # Each session's tokens fit its blocks; the blocks (a shared prefix block once) fit
            # the worker: it is never asked to hold more than it has.
            assert held <= sum(core.workers.reserved(sid) for sid in w.sessions)
            assert w.reserved_tokens <= w.spec.capacity_tokens, "a worker was asked to hold more than it has"
        if on_tick:
            on_tick(plan, out)
    raise AssertionError("did not finish")


def test_reserve_policy_is_the_default():
    assert SchedulerLimits().kv_policy == "reserve"
    with pytest.raises(ValueError, match="kv_policy"):
        SchedulerLimits(kv_policy="yolo")


def test_growth_preempts_and_every_session_still_gets_its_tokens():
    # 3 sessions of 4 + 12 tokens need 15 tokens each at most; 32 tokens of KV hold two.
    core, fake = _core(capacity_tokens=32), FakeWorkers()
    ids = [core.submit(SessionRequest(prompt_ids=(1, 2, 3, 4), max_new_tokens=12)) for _ in range(3)]
    finished = _run(core, fake, 32)
    assert core.preemptions > 0
    assert core.snapshot().preemptions_total == core.preemptions
    for sid in ids:
        assert finished[sid] == FinishReason.LENGTH
        assert core.session(sid).generated == [fake_token(sid, i) for i in range(12)]
    assert all(w.reserved_tokens == 0 for w in core.workers)


def test_under_reserve_policy_the_same_load_waits_instead():
    limits = SchedulerLimits(max_running=8, prefill_token_budget=64)
    core = SchedulerCore(limits)
    core.add_worker(WorkerSpec("w0", 32, 4, BPT), vocab_size=48, max_position=512)
    for _ in range(3):
        core.submit(SessionRequest(prompt_ids=(1, 2, 3, 4), max_new_tokens=12))
    plan, _ = plan_tick(core)
    assert len(plan.prefill) == 2  # the third does not fit its worst case yet
    assert core.preemptions == 0


def test_the_victim_is_the_least_urgent_then_the_newest():
    core, fake = _core(capacity_tokens=24), FakeWorkers()
    urgent = core.submit(SessionRequest(prompt_ids=(1,) * 4, max_new_tokens=12, priority=0))
    lax = core.submit(SessionRequest(prompt_ids=(2,) * 4, max_new_tokens=12, priority=5))
    newest = core.submit(SessionRequest(prompt_ids=(3,) * 4, max_new_tokens=12, priority=0))
    first_victim = []

    def watch(plan, out):
        if core.preemptions and not first_victim:
            first_victim.append([s for s in (urgent, lax, newest) if core.session(s).phase.value == "queued"])

    _run(core, fake, 24, on_tick=watch)
    assert first_victim and first_victim[0] == [lax]


@pytest.mark.parametrize("seed", range(20))
def test_random_loads_finish_within_capacity(seed):
    rng = random.Random(seed)
    capacity = rng.choice([16, 24, 40])
    core = _core(
        capacity_tokens=capacity,
        block=rng.choice([1, 2, 4]),
        workers=rng.randint(1, 2),
        max_running=rng.randint(1, 6),
        prefill_token_budget=rng.randint(2, 16),
    )
    fake = FakeWorkers()
    ids = []
    for _ in range(rng.randint(3, 12)):
        p, n = rng.randint(1, 6), rng.randint(1, capacity - 7)
        ids.append(
            core.submit(SessionRequest(prompt_ids=tuple(range(p)), max_new_tokens=n, priority=rng.randint(0, 2)))
        )
    finished = _run(core, fake, capacity)
    for sid in ids:
        s = core.session(sid)
        assert finished[sid] == FinishReason.LENGTH
        assert s.generated == [fake_token(sid, i) for i in range(s.request.max_new_tokens)]
    assert all(w.reserved_tokens == 0 for w in core.workers) and not fake.kv

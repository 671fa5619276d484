"""The per-caller queue share (SchedulerLimits.max_queued_per_caller), on the pure core: one
caller cannot fill the queue for all; the others are still admitted."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.core import (
    AdmissionRejected,
    RejectReason,
    SchedulerCore,
    SchedulerLimits,
    SessionRequest,
    WorkerSpec,
)
from scheduler_svc.core.admission import check_caller_room

CAP = 3


def make_core(**limits) -> SchedulerCore:
    core = SchedulerCore(SchedulerLimits(**{"max_queued_per_caller": CAP, "max_running": 1, **limits}))
    core.add_worker(WorkerSpec("w0", capacity_tokens=4096, block_size=16, kv_bytes_per_token=64), 100, 512)
    return core


def req(owner: str) -> SessionRequest:
    return SessionRequest(prompt_ids=(1, 2, 3), max_new_tokens=2, owner=owner)


def queued_by(core: SchedulerCore, owner: str) -> int:
    return sum(1 for sid in core.queued_ids() if core.session(sid).request.owner == owner)


def test_one_caller_is_capped_and_the_others_are_still_admitted() -> None:
    core = make_core()
    for _ in range(CAP):
        core.submit(req("token:a"))
    with pytest.raises(AdmissionRejected) as info:
        core.submit(req("token:a"))
    assert info.value.reason == RejectReason.QUEUE_FULL
    assert "max_queued_per_caller is 3" in info.value.message and "3 sessions queued" in info.value.message
    assert core.snapshot().rejected_by_reason == {"queue_full": 1}
    # Another caller, and anonymous callers, have their own share.
    for _ in range(CAP):
        core.submit(req("token:b"))
        core.submit(req(""))
    assert queued_by(core, "token:a") == queued_by(core, "token:b") == queued_by(core, "") == CAP


def test_a_workload_beyond_the_share_is_refused_whole() -> None:
    core = make_core()
    core.submit(req("peer:alice"))
    with pytest.raises(AdmissionRejected) as info:
        core.submit_workload([req("peer:alice")] * CAP)
    assert "cannot add 3" in info.value.message
    assert core.queue_depth == 1, "nothing of the refused workload was queued"
    wid, ids = core.submit_workload([req("peer:alice")] * (CAP - 1))
    assert len(ids) == CAP - 1 and core.queue_depth == CAP


def test_the_share_frees_up_as_sessions_leave_the_queue() -> None:
    core = make_core()
    ids = [core.submit(req("token:a")) for _ in range(CAP)]
    core.schedule()  # max_running 1: the first is admitted, so it is no longer queued
    assert queued_by(core, "token:a") == CAP - 1
    core.submit(req("token:a"))
    core.cancel(ids[1])  # a cancelled queued session leaves at once
    core.submit(req("token:a"))
    with pytest.raises(AdmissionRejected):
        core.submit(req("token:a"))


def test_anonymous_callers_share_one_share_and_are_told_so() -> None:
    with pytest.raises(AdmissionRejected) as info:
        check_caller_room(CAP, 1, "", SchedulerLimits(max_queued_per_caller=CAP))
    assert info.value.message.startswith("anonymous callers (no token, no certificate) already have 3")


def test_the_cap_is_inert_at_or_above_the_queue_depth() -> None:
    core = make_core(max_queue_depth=4, max_queued_per_caller=4)
    for _ in range(4):
        core.submit(req(""))
    with pytest.raises(AdmissionRejected) as info:
        core.submit(req(""))
    assert info.value.message.startswith("the queue holds 4 of 4"), "the global limit speaks first"


@pytest.mark.parametrize("bad", [0, -1])
def test_the_cap_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="max_queued_per_caller"):
        SchedulerLimits(max_queued_per_caller=bad)


@pytest.mark.parametrize("seed", range(5))
def test_no_caller_ever_holds_more_than_its_share(seed: int) -> None:
    """Invariant over random submits, cancels and ticks from four callers."""
    rng = random.Random(seed)
    core = make_core(max_queue_depth=10)
    owners = ["", "token:a", "token:b", "peer:c"]
    for _ in range(300):
        op = rng.random()
        if op < 0.6:
            owner = rng.choice(owners)
            try:
                core.submit_workload([req(owner)] * rng.randint(1, 2))
            except AdmissionRejected as exc:
                assert exc.reason == RejectReason.QUEUE_FULL
        elif op < 0.8 and core.queued_ids():
            core.cancel(rng.choice(core.queued_ids()))
        else:
            core.schedule()
        for owner in owners:
            assert queued_by(core, owner) <= CAP
        assert core.queue_depth <= 10

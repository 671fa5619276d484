"""A fake worker for driving the scheduler core without a network or a model (unit tests only)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set

from scheduler_svc.core import (
    SchedulerCore,
    StepResult,
    StepStatus,
    TickOutcome,
    TickPlan,
    WorkerSpec,
)


def sequential_ids() -> Callable[[str], str]:
    """Readable ids for tables (s0, s1, ... and w0, ...); the service issues random ones."""
    counters: dict[str, int] = {}

    def new_id(prefix: str) -> str:
        n = counters.get(prefix, 0)
        counters[prefix] = n + 1
        return f"{prefix}{n}"

    return new_id


def settled(plan: TickPlan) -> TickOutcome:
    """What schedule() settled while planning (cancellations, preemptions), as an outcome."""
    return TickOutcome(
        tick=plan.tick,
        finished=list(plan.finished),
        requeued=list(plan.requeued),
        release={w: list(s) for w, s in plan.release.items()},
    )


def plan_tick(core: SchedulerCore) -> tuple[TickPlan, TickOutcome]:
    plan = core.schedule()
    return plan, settled(plan)


def complete_tick(
    core: SchedulerCore,
    plan: TickPlan,
    results: Mapping[str, StepResult],
    failed_workers: Set[str] = frozenset(),
    outcome: TickOutcome | None = None,
    failed_steps: Mapping[str, str] | None = None,
) -> TickOutcome:
    """update(), with what schedule() settled first (the whole tick's effects in one outcome)."""
    out = core.update(plan, results, failed_workers, failed_steps)
    if outcome is None:
        return out
    merged = TickOutcome(
        tick=plan.tick,
        tokens=outcome.tokens + out.tokens,
        finished=outcome.finished + out.finished,
        requeued=outcome.requeued + out.requeued,
        dropped=outcome.dropped + out.dropped,
    )
    for part in (outcome, out):
        for w, sids in part.release.items():
            merged.release.setdefault(w, []).extend(sids)
    return merged


def fake_token(session_id: str, index: int, vocab: int = 48) -> int:
    return (sum(map(ord, session_id)) * 7 + index * 13) % vocab


class FakeWorkers:
    """Holds per-session KV token counts the way a worker would and answers every step."""

    def __init__(self) -> None:
        self.kv: dict[str, int] = {}
        self.owner: dict[str, str] = {}  # session -> the worker whose cache holds its KV

    def run(self, plan: TickPlan) -> dict[str, StepResult]:
        results = {}
        for p in plan.prefill:
            held = self.kv.get(p.session_id, 0)
            if held != p.start_position:
                results[p.session_id] = StepResult(p.session_id, StepStatus.CACHE_MISS, None, held)
                continue
            self.kv[p.session_id] = held + len(p.token_ids)
            self.owner[p.session_id] = p.worker_id
            tok = fake_token(p.session_id, p.generated_so_far) if p.last_chunk else None
            results[p.session_id] = StepResult(p.session_id, StepStatus.OK, tok, self.kv[p.session_id])
        for d in plan.decode:
            held = self.kv.get(d.session_id)
            if held != d.position:
                results[d.session_id] = StepResult(d.session_id, StepStatus.CACHE_MISS, None, held or 0)
                continue
            self.kv[d.session_id] = held + 1
            results[d.session_id] = StepResult(
                d.session_id, StepStatus.OK, fake_token(d.session_id, d.generated_so_far), held + 1
            )
        return results

    def release(self, outcome: TickOutcome) -> None:
        for sids in outcome.release.values():
            for sid in sids:
                self.kv.pop(sid, None)
                self.owner.pop(sid, None)

    def held_on(self, worker_id: str) -> int:
        """KV tokens this worker's cache holds, over all its sessions."""
        return sum(self.kv[sid] for sid, w in self.owner.items() if w == worker_id)

    def drop_worker(self, worker_id: str) -> list[str]:
        """The worker died: its cache is gone. Returns the sessions it held."""
        lost = sorted(sid for sid, w in self.owner.items() if w == worker_id)
        for sid in lost:
            del self.kv[sid], self.owner[sid]
        return lost

    def lose(self, session_id: str) -> None:
        """Forget one session's KV (e.g. evicted), so its next step is answered CACHE_MISS."""
        self.kv.pop(session_id, None)
        self.owner.pop(session_id, None)


def tiny_worker(worker_id: str = "w0", blocks: int = 1024, block_size: int = 16) -> WorkerSpec:
    return WorkerSpec(
        worker_id=worker_id,
        capacity_tokens=blocks * block_size,
        block_size=block_size,
        kv_bytes_per_token=1536,
        weight_bytes=0,
    )


def run_to_completion(
    core: SchedulerCore, workers: FakeWorkers, max_ticks: int = 10_000, on_tick=None
) -> list[TickOutcome]:
    outcomes = []
    while core.has_work():
        plan, early = plan_tick(core)
        workers.release(early)
        if plan.empty:
            outcomes.append(early)
            if not core.has_work():
                break
            raise AssertionError("scheduler has work but planned nothing")
        out = complete_tick(core, plan, workers.run(plan), outcome=early)
        workers.release(out)
        outcomes.append(out)
        if on_tick:
            on_tick(plan, out)
        assert len(outcomes) < max_ticks
    return outcomes

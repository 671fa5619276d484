"""A fake worker for driving the scheduler core without a network or a model (unit tests only)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set

from scheduler_svc.core import (
    SchedulerCore,
    SchedulerLimits,
    SessionRequest,
    StepResult,
    StepStatus,
    TickOutcome,
    TickPlan,
    WorkerSpec,
)

BPT = 1536  # the tiny model's KV bytes a token: 2 (K and V) x 6 layers x hidden 32 x 4 bytes
VOCAB = 48
MAX_POSITION = 2048


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


def books(core: SchedulerCore) -> tuple:
    """Everything a tick is planned from and may change, as plain values (to compare states)."""
    st = core._state
    sessions = {
        sid: {k: (tuple(v) if isinstance(v, list) else v) for k, v in vars(s).items()} for sid, s in st.sessions.items()
    }
    workers = []
    for slot in core.workers:
        t, a = slot.tables, slot.tables.allocator
        tables = {sid: (tuple(x.blocks), x.root, tuple(x.chain), x.sent) for sid, x in t._tables.items()}
        alloc = (tuple(a._free), tuple(a._cached.items()), dict(a._refs), dict(a._by_hash), dict(a._hash_of))
        workers.append((slot.spec.worker_id, slot.live, frozenset(slot.sessions), tables, alloc, t.prefix_hits))
    return (
        sessions,
        tuple(st.queue),
        tuple(st.running),
        dict(st.finish_requested),
        dict(st.ahead),
        st.tick,
        workers,
        core.accounting.completed,
        core.preemptions,
    )


def plan_tick(core: SchedulerCore) -> tuple[TickPlan, TickOutcome]:
    """schedule(), as plan then apply, checking on the way that planning is pure: a plan leaves
    the core as it was, and planning twice gives the same plan."""
    before = books(core)
    plan = core.plan()
    assert books(core) == before, "planning changed the core's state"
    again = core.plan(now=plan.started)  # (a test's clock may advance at every reading)
    assert again == plan, "two plans from one state differ"
    core.apply(plan)
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
    """Holds per-session KV token counts the way a worker would and answers every step. It also
    keeps the token ids each session's KV holds and each one's last sampled token, which a
    decode planned ahead (``last_sampled``) takes as its input, as a real worker does."""

    def __init__(self) -> None:
        self.kv: dict[str, int] = {}
        self.owner: dict[str, str] = {}  # session -> the worker whose cache holds its KV
        self.seq: dict[str, list[int]] = {}  # session -> the token ids in its KV
        self.last: dict[str, int] = {}  # session -> the token sampled last

    def run(self, plan: TickPlan) -> dict[str, StepResult]:
        results = {}
        for p in plan.prefill:
            held = self.kv.get(p.session_id, 0)
            if held != p.start_position:
                results[p.session_id] = StepResult(p.session_id, StepStatus.CACHE_MISS, None, held)
                continue
            self.kv[p.session_id] = held + len(p.token_ids)
            self.owner[p.session_id] = p.worker_id
            seq = self.seq.setdefault(p.session_id, [])
            del seq[p.start_position :]
            seq.extend(p.token_ids)
            tok = fake_token(p.session_id, p.generated_so_far) if p.last_chunk else None
            if tok is not None:
                self.last[p.session_id] = tok
            results[p.session_id] = StepResult(p.session_id, StepStatus.OK, tok, self.kv[p.session_id])
        for d in plan.decode:
            held = self.kv.get(d.session_id, -1)  # -1: none held (no position is -1)
            token = self.last.get(d.session_id) if d.last_sampled else d.token_id
            if not d.last_sampled and d.session_id in self.last:
                # The scheduler names the token it was given: the one this worker sampled last.
                assert token == self.last[d.session_id], (d.session_id, token, self.last[d.session_id])
            if held != d.position or token is None:
                results[d.session_id] = StepResult(d.session_id, StepStatus.CACHE_MISS, None, max(held, 0))
                continue
            self.kv[d.session_id] = held + 1
            self.seq[d.session_id].append(token)
            self.last[d.session_id] = fake_token(d.session_id, d.generated_so_far)
            results[d.session_id] = StepResult(d.session_id, StepStatus.OK, self.last[d.session_id], held + 1)
        return results

    def release(self, outcome: TickOutcome) -> None:
        for sids in outcome.release.values():
            for sid in sids:
                self.lose(sid)

    def held_on(self, worker_id: str) -> int:
        """KV tokens this worker's cache holds, over all its sessions."""
        return sum(self.kv[sid] for sid, w in self.owner.items() if w == worker_id)

    def drop_worker(self, worker_id: str) -> list[str]:
        """The worker died: its cache is gone. Returns the sessions it held."""
        lost = sorted(sid for sid, w in self.owner.items() if w == worker_id)
        for sid in lost:
            self.lose(sid)
        return lost

    def lose(self, session_id: str) -> None:
        """Forget one session's KV (e.g. evicted), so its next step is answered CACHE_MISS."""
        self.kv.pop(session_id, None)
        self.owner.pop(session_id, None)
        self.seq.pop(session_id, None)
        self.last.pop(session_id, None)


def tiny_worker(worker_id: str = "w0", blocks: int = 1024, block_size: int = 16) -> WorkerSpec:
    return WorkerSpec(
        worker_id=worker_id,
        capacity_tokens=blocks * block_size,
        block_size=block_size,
        kv_bytes_per_token=BPT,
        weight_bytes=0,
    )


def req(prompt_len: int, max_new: int, priority: int = 0, **kw) -> SessionRequest:
    """A session of ``prompt_len`` tokens (1, 2, ... cycling below VOCAB) wanting ``max_new``."""
    prompt = tuple(1 + i % (VOCAB - 1) for i in range(prompt_len))
    return SessionRequest(prompt_ids=prompt, max_new_tokens=max_new, priority=priority, **kw)


def make_core(
    workers: tuple[WorkerSpec, ...] = (tiny_worker(),),
    vocab: int = VOCAB,
    max_position: int = MAX_POSITION,
    clock=None,
    **limits,
) -> SchedulerCore:
    """A core with ``workers`` added (the tiny model's vocabulary and context by default)."""
    core = SchedulerCore(SchedulerLimits(**limits), new_id=sequential_ids(), **({"clock": clock} if clock else {}))
    for spec in workers:
        core.add_worker(spec, vocab, max_position)
    return core


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


def run_overlapped(
    core: SchedulerCore,
    workers: FakeWorkers,
    max_ticks: int = 10_000,
    on_land: Callable[[TickPlan, TickOutcome], None] | None = None,
) -> list[TickOutcome]:
    """Drive the core as the runtime's overlapped loop does: tick N+1 is planned, and the workers
    run it (after N, as a worker runs its steps in order), before N's results are applied. The
    releases schedule() settles ride on its own tick's steps; those update(N) names ride on
    tick N+2's, so they reach the workers after N+1 ran. `on_land` sees each applied tick."""
    outcomes: list[TickOutcome] = []
    out_now: tuple[TickPlan, dict[str, StepResult]] | None = None
    while core.has_work() or out_now is not None:
        plan, early = plan_tick(core)
        workers.release(early)
        outcomes.append(early)
        sent = None if plan.empty else (plan, workers.run(plan))
        if out_now is not None:
            out = core.update(*out_now)
            workers.release(out)
            outcomes.append(out)
            if on_land is not None:
                on_land(out_now[0], out)
        elif sent is None:
            if not core.has_work():
                break
            raise AssertionError("scheduler has work but planned nothing")
        out_now = sent
        assert len(outcomes) < 2 * max_ticks
    return outcomes

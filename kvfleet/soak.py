"""A bounded soak: many sessions of random lengths, many concurrent streams, random cancels and
deadlines, one worker killed and restarted midway. Nothing a client was promised may be lost."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvfleet.client import SchedulerClient, build_request
from kvfleet.local_cluster import LocalCluster
from kvfleet.progress import Progress
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from kvfleet_common import security


@dataclass(frozen=True)
class SoakSpec:
    sessions: int = 300
    concurrency: int = 64
    prompt_len: tuple[int, int] = (4, 48)
    new_tokens: tuple[int, int] = (4, 40)
    cancel_share: float = 0.1  # cancelled by the client after a few tokens
    deadline_share: float = 0.1  # sent with a deadline too short to finish
    sampled_share: float = 0.3  # seeded sampling instead of greedy
    kill_after_share: float = 0.4  # kill a worker when this share of sessions has ended
    restart_after_s: float = 3.0
    seed: int = 0
    time_limit_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("sessions", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("prompt_len", "new_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range of at least 1 token: each session takes {lo}..{hi}")
        for name in ("cancel_share", "deadline_share", "sampled_share", "kill_after_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in 0..1, got {getattr(self, name)}")
        if self.restart_after_s < 0 or self.time_limit_s <= 0:
            raise ValueError("restart_after_s must be >= 0 and time_limit_s > 0")


@dataclass
class _Plan:
    index: int
    prompt: list[int]
    new_tokens: int
    temperature: float
    seed: int
    cancel_after: int | None
    deadline_s: float | None


@dataclass
class SoakReport:
    outcomes: Counter = field(default_factory=Counter)  # completed / cancelled / expired / rejected / lost
    mismatched: list[int] = field(default_factory=list)  # completed sessions whose tokens differ
    lost_details: list[str] = field(default_factory=list)
    mismatch_details: list[str] = field(default_factory=list)
    kv_bytes_after: int = -1
    worker_sessions_after: int = -1
    rss_before_kb: dict[str, int] = field(default_factory=dict)
    rss_after_kb: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    killed_worker: str = ""

    def lines(self) -> list[str]:
        o = self.outcomes
        out = [
            f"sessions: completed {o['completed']}, cancelled {o['cancelled']}, expired {o['expired']}, "
            f"rejected {o['rejected']}, lost {o['lost']}",
            f"completed sessions equal to their solo reference: {o['completed'] - len(self.mismatched)}"
            f" of {o['completed']}",
            f"KV bytes at the end: {self.kv_bytes_after}; sessions held by workers: {self.worker_sessions_after}",
            f"worker killed and restarted midway: {self.killed_worker or 'none'}",
            f"duration: {self.duration_s:.1f}s",
        ]
        for name in sorted(self.rss_before_kb):
            out.append(
                f"resident memory {name}: {self.rss_before_kb[name] / 1024:.0f} MiB before, "
                f"{self.rss_after_kb.get(name, 0) / 1024:.0f} MiB after"
            )
        out += [f"lost: {d}" for d in self.lost_details[:10]]
        out += [f"mismatched: {d}" for d in self.mismatch_details[:10]]
        return out

    @property
    def ok(self) -> bool:
        return (
            self.outcomes["lost"] == 0
            and not self.mismatched
            and self.kv_bytes_after == 0
            and self.worker_sessions_after == 0
        )


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _plans(spec: SoakSpec, vocab: int) -> list[_Plan]:
    rng = random.Random(spec.seed)
    plans = []
    for i in range(spec.sessions):
        n = rng.randint(*spec.new_tokens)
        roll = rng.random()
        plans.append(
            _Plan(
                index=i,
                prompt=[rng.randrange(vocab) for _ in range(rng.randint(*spec.prompt_len))],
                new_tokens=n,
                temperature=0.8 if rng.random() < spec.sampled_share else 0.0,
                seed=rng.randrange(2**31),
                cancel_after=rng.randint(1, max(1, n - 1)) if roll < spec.cancel_share else None,
                deadline_s=0.05 if spec.cancel_share <= roll < spec.cancel_share + spec.deadline_share else None,
            )
        )
    return plans


def _request(p: _Plan):
    return build_request(p.prompt, p.new_tokens, temperature=p.temperature, seed=p.seed, ignore_eos=True)


def run_soak(
    cluster: LocalCluster, spec: SoakSpec, reference: Callable[[_Plan], list[int]], progress: Progress | None = None
) -> SoakReport:
    progress = progress or Progress.silent()
    progress.set_total(spec.sessions)
    report = SoakReport()
    names = [n for n in cluster.procs if n != "telemetry"]
    report.rss_before_kb = {n: _rss_kb(cluster.pid(n)) for n in names}
    client = SchedulerClient(cluster.scheduler_address, cluster.client_tls, cluster.spec.api_token)
    vocab = client.list_workers()[0].vocab_size
    plans = _plans(spec, vocab)
    results: dict[int, list[int]] = {}
    lock = threading.Lock()
    ended = [0]
    start = time.monotonic()

    def one(p: _Plan) -> None:
        tokens: list[int] = []
        outcome = "lost"
        try:
            stream: Any = client.stream(_request(p), timeout=p.deadline_s or spec.time_limit_s)  # a grpc call
            finished = False
            for ev in stream:
                tokens.extend(ev.token_ids)
                if p.cancel_after is not None and len(tokens) >= p.cancel_after and not ev.finished:
                    stream.cancel()
                    outcome = "cancelled"
                    break
                finished = finished or ev.finished
            if finished:
                outcome = "completed"
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.CANCELLED and p.cancel_after is not None:
                outcome = "cancelled"
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED and p.deadline_s is not None:
                outcome = "expired"
            elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                outcome = "rejected"
            else:
                with lock:
                    report.lost_details.append(f"session {p.index}: {code.name} {exc.details()}")
        with lock:
            report.outcomes[outcome] += 1
            if outcome == "completed":
                results[p.index] = tokens
            ended[0] += 1
            progress.advance()

    def chaos() -> None:
        while ended[0] < spec.kill_after_share * len(plans):
            time.sleep(0.05)
        victim = len(cluster.worker_addresses) - 1
        report.killed_worker = f"worker-{victim}"
        progress(f"killing {report.killed_worker} (SIGKILL) with {len(plans) - ended[0]} sessions to go")
        cluster.kill_worker(victim)
        time.sleep(spec.restart_after_s)
        cluster.restart_worker(victim)
        progress(f"{report.killed_worker} restarted")

    chaos_thread = threading.Thread(target=chaos, daemon=True)
    chaos_thread.start()
    with ThreadPoolExecutor(spec.concurrency) as pool:
        list(pool.map(one, plans))
    chaos_thread.join(60)
    report.duration_s = time.monotonic() - start

    progress("checking completed sessions against their solo references")
    for p in plans:
        if p.index in results and results[p.index] != (expected := reference(p)):
            report.mismatched.append(p.index)
            report.mismatch_details.append(f"session {p.index}: got {results[p.index]}, solo {expected}")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        snap = client.telemetry()
        if snap.kv_total_bytes == 0 and snap.active_sessions == 0:
            break
        time.sleep(0.1)
    report.kv_bytes_after = snap.kv_total_bytes
    held = 0
    for address in cluster.worker_addresses:
        with security.channel(address, cluster.client_tls) as ch:
            held += wpb_grpc.WorkerStub(ch).GetStats(wpb.GetStatsRequest(), timeout=10).active_sessions
    report.worker_sessions_after = held
    report.rss_after_kb = {n: _rss_kb(cluster.pid(n)) for n in names}
    client.close()
    return report


def engine_reference(model: str) -> Callable[[_Plan], list[int]]:
    """Each session run alone (batch of one) on a local engine: the solo reference."""
    from kvfleet_models.registry import load_model
    from worker_svc.engine import DecodeItem, Engine, EngineConfig, PrefillItem, SamplingSpec
    from worker_svc.local import LocalSteps

    cfg, weights = load_model(model)
    driver = LocalSteps(Engine(cfg, weights, EngineConfig(num_blocks=256, block_size=16)))  # it keeps the blocks

    def _token(out) -> int:
        token = out.results[0].token_id
        assert token is not None, "the reference engine held the session's KV"
        return int(token)

    def run(p: _Plan) -> list[int]:
        sampling = SamplingSpec(temperature=p.temperature, seed=p.seed)
        out = driver.step([PrefillItem("ref", tuple(p.prompt), 0, True, sampling, 0)], [])
        tokens = [_token(out)]
        while len(tokens) < p.new_tokens:
            pos = len(p.prompt) + len(tokens) - 1
            out = driver.step([], [DecodeItem("ref", tokens[-1], pos, sampling, len(tokens))])
            tokens.append(_token(out))
        driver.release(["ref"])
        return tokens

    return run

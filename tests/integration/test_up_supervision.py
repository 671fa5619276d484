"""`kvfleet up` as a user runs it (a subprocess) keeps serving when a worker is SIGKILLed: the
streams in flight finish with exactly their solo tokens, the worker is restarted and serves again,
and only SIGTERM stops the cluster."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import grpc
import pytest

from kvfleet.client import NO_RETRY, SchedulerClient, build_request
from tests.helpers.processes import running, wait_for_children
from tests.helpers.telemetry_db import wait_for_rows
from tests.helpers.up import Up, wait_live


def _kill_a_worker_mid_stream(
    up: Up, prompts: list, new_tokens: int, solo: list[list[int]], restart_timeout_s: float
) -> None:
    # The raw call, no client retry: the cluster itself must keep the streams whole.
    with SchedulerClient(up.scheduler, retry=NO_RETRY) as client:
        streams = [client.stream(build_request(p, new_tokens, ignore_eos=True)) for p in prompts]
        firsts = [next(s) for s in streams]
        assert "worker-1" in {f.worker_id for f in firsts}, "no stream on the victim; nothing tested"
        os.kill(up.pids["worker-1"], signal.SIGKILL)
        rests = [list(s) for s in streams]
        got = [list(f.token_ids) + [t for ev in rest for t in ev.token_ids] for f, rest in zip(firsts, rests)]
        for p, tokens, expected in zip(prompts, got, solo):
            assert tokens == expected, p
        # The kill cut a stream short: one begun on worker-1 was finished by worker-0.
        moved = [
            f.worker_id == "worker-1" and any(ev.worker_id == "worker-0" for ev in rest)
            for f, rest in zip(firsts, rests)
        ]
        assert any(moved), "every stream on the victim had ended before the kill; nothing tested"
        assert up.proc.poll() is None, f"kvfleet up stopped:\n{up.stderr()}"
        wait_live(client, "worker-1", restart_timeout_s)
        log = up.stderr()
        assert re.search(r"worker-1 exited with code -9 .*restarting in", log), log
        assert "worker-1 restarted" in log
        # New sessions are served afterwards, on both workers (the restarted one included).
        streams = [client.stream(build_request(p, new_tokens, ignore_eos=True)) for p in prompts]
        events = [list(s) for s in streams]
        assert [[t for ev in evs for t in ev.token_ids] for evs in events] == solo
        assert {evs[0].worker_id for evs in events} == {"worker-0", "worker-1"}, "the restarted worker got none"


@pytest.mark.slow
def test_up_keeps_serving_when_a_worker_is_killed(tmp_path: Path):
    """`kvfleet up` as the README's quick start runs it, on SmolLM2 (a copy of this test on the
    tiny model, 18 s of CPU on the AVX2 EPYC for the same supervision, which is no more the
    model's than the start is, was folded into this one in session 37)."""
    prompts = [
        "The capital of France is",
        "def add(a, b):",
        "Three colors:",
        "In 1969,",
        "The sea is",
        "Once upon a time",
    ]
    new_tokens = 12
    # 256 KV blocks a worker (~190 MB) instead of the default 3 GB: the same supervision, less memory.
    # (SmolLM2's CPU steps, tens of ms, are too long to pack: the streams spread over both workers.)
    up = Up(
        ["--model", "smollm2-135m", "--workers", "2", "--num-blocks", "256"], tmp_path / "up.err", start_timeout_s=120
    )
    # Its start was told part by part on stderr, in order (a model's load is otherwise silent).
    parts = re.findall(r"^kvfleet: (.+) ready \((\d+\.\d) s\)$", up.stderr(), re.M)
    assert [p for p, _ in parts] == ["telemetry", "2 workers (smollm2-135m)", "scheduler", "gateway"], up.stderr()
    assert [float(s) for _, s in parts] == sorted(float(s) for _, s in parts)
    try:
        with SchedulerClient(up.scheduler) as client:  # each prompt alone: its solo tokens
            assert {w.kv_capacity_tokens for w in client.list_workers()} == {256 * 16}  # --num-blocks reached them
            # The cores shared out between the two CPU workers (ClusterSpec.worker_threads).
            share = str(max(1, len(os.sched_getaffinity(0)) // 2))
            for name in ("worker-0", "worker-1"):
                argv = Path(f"/proc/{up.pids[name]}/cmdline").read_bytes().decode().split("\0")
                assert argv[argv.index("--threads") + 1] == share, argv
            solo = [client.generate(build_request(p, new_tokens, ignore_eos=True)).token_ids for p in prompts]
        _kill_a_worker_mid_stream(up, prompts, new_tokens, solo, restart_timeout_s=90)
    finally:
        code = up.stop()
    assert code == 0, up.stderr()
    assert "draining" in up.proc.stdout.read().decode()


def test_up_hands_its_drain_grace_on_and_a_closed_terminal_stops_it(tmp_path: Path):
    """SIGHUP (the terminal closed) drains and stops the cluster like SIGTERM, leaving no child;
    --drain-grace reaches the scheduler and the gateway, whose drains it bounds (and
    --no-step-stream, --no-step-spans, --kv-budget-bytes and --pack-step-ms the scheduler)."""
    import time

    up = Up(
        [
            *("--model", "tiny", "--workers", "1", "--drain-grace", "3", "--no-step-stream", "--no-step-spans"),
            *("--kv-budget-bytes", "1536000", "--pack-step-ms", "0.5"),
        ],
        tmp_path / "up.err",
        start_timeout_s=60,
    )
    try:
        for name in ("scheduler", "gateway"):
            args = Path(f"/proc/{up.pids[name]}/cmdline").read_bytes().split(b"\0")
            assert args[args.index(b"--drain-grace") + 1] == b"3.0", (name, args)
        # --no-step-stream reaches the scheduler too (it then serves with a Step call a step).
        args = Path(f"/proc/{up.pids['scheduler']}/cmdline").read_bytes().split(b"\0")
        assert b"--no-step-stream" in args
        assert args[args.index(b"--pack-step-ms") + 1] == b"0.5"  # and --pack-step-ms
        with SchedulerClient(up.scheduler) as client:
            assert client.generate(build_request([1, 2, 3], 4, ignore_eos=True)).token_ids
            assert client.telemetry().kv_budget_bytes == 1536000  # --kv-budget-bytes in force
        # --no-step-spans: the request's trace has its session span and ticks, and no step spans
        # (the scheduler exports in order: its step spans would have come before its session's end).
        db = up.log_dir / "telemetry.db"
        rows = wait_for_rows(
            db,
            "SELECT name FROM spans WHERE service = 'kvfleet-scheduler'",
            until=lambda r: {"text_completion tiny", "tick"} <= {n for (n,) in r},
            what="the request's session span and its ticks",
        )
        assert not [n for (n,) in rows if n.startswith("step_")], rows
        up.proc.send_signal(signal.SIGHUP)
        assert up.proc.wait(60) == 0, up.stderr()
    finally:
        up.stop()
    out = up.proc.stdout.read().decode()
    assert "draining (up to 11s" in out, out  # 2 x 3 s + the margin
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in up.pids.values()):
        assert time.monotonic() < deadline, f"children left running: {up.pids}"
        time.sleep(0.1)


def test_the_services_of_a_killed_kvfleet_up_stop_by_themselves(tmp_path: Path):
    """SIGKILL leaves `kvfleet up` no chance to stop what it started: each service notices that
    its parent is gone (KVFLEET_PARENT_PID) and stops by itself within seconds, instead of
    holding its port and memory as an orphan."""
    up = Up(["--model", "tiny", "--workers", "1"], tmp_path / "up.err", start_timeout_s=60)
    pids = dict(up.pids)
    assert {"scheduler", "worker-0", "telemetry"} <= set(pids), up.banner
    up.proc.kill()
    up.proc.wait()
    try:
        end = time.monotonic() + 30
        while (alive := sorted(n for n, p in pids.items() if running(p))) and time.monotonic() < end:
            time.sleep(0.2)
        assert not alive, f"still running 30 s after kvfleet up was killed: {alive}"
    finally:
        for pid in pids.values():
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(up.log_dir, ignore_errors=True)  # its own to remove, had it not been killed


def _a_session_held_running(client: SchedulerClient, worker_pid: int):
    """A session admitted while its worker is stopped (SIGSTOP): it stays running until the
    worker is continued or the cluster cuts it. Returns its stream."""
    os.kill(worker_pid, signal.SIGSTOP)
    stream = client.stream(build_request([1, 2, 3], 200, ignore_eos=True))
    end = time.monotonic() + 30
    while client.telemetry().active_sessions == 0:
        assert time.monotonic() < end, "the session never started"
        time.sleep(0.05)
    return stream


def test_ctrl_c_drains_and_a_second_ctrl_c_kills_at_once(tmp_path: Path):
    """README: Ctrl-C drains (running sessions get --drain-grace), a second Ctrl-C kills at once.
    A session is held running by a stopped worker, so the drain would last the whole grace (60 s
    here); the second SIGINT ends `kvfleet up` and every process it started within seconds."""
    up = Up(
        ["--model", "tiny", "--workers", "1", "--no-gateway", "--drain-grace", "60"],
        tmp_path / "up.err",
        start_timeout_s=60,
    )
    pids = dict(up.pids)
    try:
        with SchedulerClient(up.scheduler, retry=NO_RETRY) as client:
            stream = _a_session_held_running(client, pids["worker-0"])
            up.proc.send_signal(signal.SIGINT)
            out = up._read_until("Ctrl-C again to kill now", 30)
            assert "draining (up to" in out, out
            time.sleep(1.0)
            assert up.proc.poll() is None, "the drain ended although the session could not"
            started = time.monotonic()
            up.proc.send_signal(signal.SIGINT)
            assert up.proc.wait(15) == 0, up.stderr()
            assert time.monotonic() - started < 10
            with pytest.raises(grpc.RpcError):  # the session was cut, not finished
                list(stream)
        assert "killing" in up.proc.stdout.read().decode()
        end = time.monotonic() + 10
        while alive := sorted(n for n, p in pids.items() if running(p)):
            assert time.monotonic() < end, f"left running after the second Ctrl-C: {alive}"
            time.sleep(0.1)
    finally:
        for pid in pids.values():
            if running(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        up.stop()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_while_starting_leaves_no_process_behind(tmp_path: Path, sig: int):
    """`kvfleet up`'s children run in sessions of their own (out of the terminal's Ctrl-C), so a
    Ctrl-C or SIGTERM while it starts must stop each one it started: it exits with 130 and says so.
    (Before, the signal ended `up` alone, SIGTERM by its default action and Ctrl-C with a traceback:
    its children, undrained, stopped only once their parent-watch saw it gone.)"""
    up = Up(["--model", "tiny", "--workers", "2", "--no-gateway"], tmp_path / "up.err", 60, wait=False)
    started: list[int] = []
    try:
        # The telemetry is up and the workers are loading (seconds: each imports torch).
        started = wait_for_children(up.proc, 3, 60, up.stderr)
        up.proc.send_signal(sig)
        assert up.proc.wait(30) == 130, up.stderr()
        assert "kvfleet: stopped while starting" in up.stderr()
        assert "kvfleet is up" not in up.proc.stdout.read().decode(), "it had finished starting: nothing tested"
        assert [p for p in started if running(p)] == []
    finally:
        for pid in started:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        up.stop()


def test_a_session_still_running_when_the_drain_grace_ends_is_cut_off(tmp_path: Path):
    """README: a drain gives running sessions --drain-grace seconds, then cuts them off. A session
    held running by a stopped worker outlasts a 1 s grace: its stream ends with an error within
    seconds, not at its end, and `kvfleet up` then stops with exit code 0."""
    up = Up(
        ["--model", "tiny", "--workers", "1", "--no-gateway", "--drain-grace", "1"],
        tmp_path / "up.err",
        start_timeout_s=60,
    )
    worker = up.pids["worker-0"]
    try:
        with SchedulerClient(up.scheduler, retry=NO_RETRY) as client:
            stream = _a_session_held_running(client, worker)
            up.proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            cut_after = time.monotonic() - started
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), info.value
        # After the grace (1 s, then the server's own stop of 1 s), before `up` kills what is left
        # (twice the grace plus 5 s: a kill would end the stream too, at about 7 s).
        assert 0.8 < cut_after < 5.5, cut_after
    finally:
        os.kill(worker, signal.SIGCONT)
    assert up.proc.wait(30) == 0, up.stderr()

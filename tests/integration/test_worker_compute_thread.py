"""The worker process runs every engine call on its initial thread (worker_svc/compute.py):
the executor itself, and a real server driven the way ``python -m worker_svc`` drives it, in a
process of its own, stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from kvfleet.local_cluster import free_port
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from tests.helpers.worker_steps import prefill_item
from worker_svc.compute import HostThreadExecutor

REPO = Path(__file__).resolve().parents[2]


def test_executor_runs_calls_on_the_thread_in_run_and_passes_errors_back() -> None:
    ex = HostThreadExecutor()
    seen: list[int] = []

    def caller() -> None:
        assert ex.submit(lambda: seen.append(threading.get_ident()) or 7).result(timeout=10) == 7
        with pytest.raises(ZeroDivisionError):
            ex.submit(lambda: 1 / 0).result(timeout=10)
        ex.shutdown()

    t = threading.Thread(target=caller)
    t.start()
    ex.run(poll_s=0.05)  # returns once the caller shuts it down
    t.join()
    assert seen == [threading.get_ident()]
    with pytest.raises(RuntimeError, match="stopped"):
        ex.submit(lambda: None)


# The worker as `python -m worker_svc` runs it (its flags, its logging, build_engine on the
# initial thread, serve_on_compute_thread), with Engine.step/release wrapped to record the thread
# each runs on; once served (after the SIGTERM) it prints one JSON line of what it saw.
_WORKER = """
import json, signal, sys, threading
from worker_svc.__main__ import parse_args
from worker_svc.server import build_engine, serve_on_compute_thread

config = parse_args(sys.argv[1:])
cfg, engine = build_engine(config)
threads = []
step, release = engine.step, engine.release

def on_step(*a, **kw):
    threads.append(threading.current_thread().name)
    return step(*a, **kw)

def on_release(ids):
    threads.append(threading.current_thread().name)
    return release(ids)

engine.step, engine.release = on_step, on_release
previous = signal.getsignal(signal.SIGTERM)
serve_on_compute_thread(config, (cfg, engine))  # returns after the drain
print(json.dumps({
    "threads": threads,
    "main": threading.main_thread().name,
    "handlers_back": signal.getsignal(signal.SIGTERM) == previous,
    "fused": engine.model.fused is not None,
    "vocab_size": cfg.vocab_size,
}), flush=True)
"""


def test_steps_and_releases_run_on_the_main_thread_and_sigterm_drains(tmp_path: Path) -> None:
    """The server runs in its own process, which the test stops by SIGTERM as a supervisor
    would (the test's own process is never signalled)."""
    port = free_port()
    env = {**os.environ, "KVFLEET_CACHE_DIR": str(tmp_path / "cache")}  # the fused ops' build, if any
    args = ["--port", str(port), "--metrics-port", "0", "--num-blocks", "64", "--block-size", "16"]
    args += ["--log-level", "INFO", "--log-format", "text"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    results: dict[str, object] = {}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=120)
            stub = wpb_grpc.WorkerStub(ch)
            vocab = stub.GetInfo(wpb.GetInfoRequest(), timeout=30).model.vocab_size
            prompt = [(7 * i + 3) % vocab for i in range(20)]
            got = []
            for sid, first in (("a", 0), ("b", 2)):
                r = stub.Step(wpb.StepRequest(prefill=[prefill_item(sid, prompt, first_block=first)]), timeout=30)
                got.append(r.results[0].token_id)
            r = stub.Step(
                wpb.StepRequest(
                    # position 20 is in b's second block (2, 3), which it has already
                    decode=[wpb.DecodeItem(session_id="b", token_id=got[1], position=20, generated_so_far=1)],
                    release_session_ids=["a"],
                ),
                timeout=30,
            )
            results["decoded"] = r.results[0].status == wpb.ITEM_OK
            stub.Step(wpb.StepRequest(release_session_ids=["b"]), timeout=30)
            results["released"] = stub.GetStats(wpb.GetStatsRequest(), timeout=30).active_sessions == 0
            results["same_token"] = got[0] == got[1]
        proc.send_signal(signal.SIGTERM)  # the worker's drain, as a supervisor sends it
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert results == {"decoded": True, "released": True, "same_token": True}
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["vocab_size"] == vocab
    # 4 steps, a release in one of them, a step that only releases: all on the initial thread
    assert seen["threads"] and set(seen["threads"]) == {seen["main"]}, seen
    assert len(seen["threads"]) == 6, seen
    assert seen["handlers_back"], "serve_on_compute_thread did not give the signal handlers back"
    # The start line says which ops the CPU forward uses (README: "Faster CPU modes").
    assert f"fused CPU ops {'on' if seen['fused'] else 'off'}" in err, err
    assert "draining" in err, err

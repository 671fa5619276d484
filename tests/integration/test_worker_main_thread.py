"""The worker process runs every engine call on its initial thread, which also runs its event
loop (``serve_on_main_thread``): a real server driven the way ``python -m worker_svc`` drives it,
in a process of its own, stopped by SIGTERM; and an inline step's answer goes out before a step
sent behind it runs (a real server, its steps inline, and a client on another thread)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc

from kvfleet.local_cluster import free_port
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from tests.helpers.worker_steps import prefill_item

REPO = Path(__file__).resolve().parents[2]


# The worker as `python -m worker_svc` runs it (its flags, its logging, build_engine on the
# initial thread, serve_on_main_thread), with Engine.step/release wrapped to record the thread
# each runs on; once served (after the SIGTERM) it prints one JSON line of what it saw.
_WORKER = """
import json, signal, sys, threading
from worker_svc.__main__ import parse_args
from worker_svc.server import build_engine, serve_on_main_thread

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
serve_on_main_thread(config, (cfg, engine))  # returns after the drain
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
    assert seen["handlers_back"], "serve_on_main_thread did not give the signal handlers back"
    # The start line says which ops the CPU forward uses (README: "Faster CPU modes").
    assert f"fused CPU ops {'on' if seen['fused'] else 'off'}" in err, err
    # ... and its threads: the tiny model, not told how many, takes one (cpu_backend.default_cpu_threads).
    assert re.search(r"fused CPU ops [^,]*, whole steps (on|off), 1 thread, ", err), err
    assert "draining" in err, err


def test_an_inline_steps_answer_goes_out_before_the_step_sent_behind_it_runs() -> None:
    """Two steps sent back to back on one stream, the first held long enough that the second is
    waiting when it ends: the second must not start before the client has the first's answer
    (with overlapped scheduling the scheduler plans the next tick from that answer)."""
    import asyncio

    from kvfleet_models.config import tiny_config
    from kvfleet_models.tiny import tiny_weights
    from worker_svc.config import WorkerConfig
    from worker_svc.server import build_engine, create_server

    cfg = tiny_config()
    config = WorkerConfig(host="127.0.0.1", port=0, model="tiny", metrics_port=0, num_blocks=64, block_size=16)
    _, engine = build_engine(config, (cfg, tiny_weights(cfg, seed=0)))
    first_answered = threading.Event()
    seen: list[str] = []
    step = engine.step

    def recorded(prefill, decode, kv_views=None):  # type: ignore[no-untyped-def]
        if not seen:
            seen.append("first")
            threading.Event().wait(0.5)  # the second step is sent meanwhile
        else:
            # Only waits long when the answer is held back behind this step (the defect).
            seen.append("second after the first's answer" if first_answered.wait(5.0) else "second first")
        return step(prefill, decode, kv_views=kv_views)

    engine.step = recorded  # type: ignore[method-assign]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, port, _ = asyncio.run_coroutine_threadsafe(
        create_server(config, (cfg, engine), steps_inline=True), loop
    ).result(60)
    try:
        requests = [
            wpb.StepRequest(prefill=[prefill_item(sid, [1, 2, 3], first_block=first)])
            for sid, first in (("a", 0), ("b", 1))
        ]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            replies = []
            for reply in wpb_grpc.WorkerStub(ch).StepStream(iter(requests), timeout=60):
                first_answered.set()
                replies.append(reply)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0.5), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert [r.code for r in replies] == [0, 0] and len(replies[0].response.results) == 1
    assert seen == ["first", "second after the first's answer"]

"""The worker process runs every engine call on its initial thread (worker_svc/compute.py):
the executor itself, and a real server driven the way ``python -m worker_svc`` drives it,
stopped by SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import grpc
import pytest

from kvfleet.local_cluster import free_port
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from worker_svc.compute import HostThreadExecutor
from worker_svc.config import WorkerConfig
from worker_svc.server import build_engine, serve_on_compute_thread


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


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_steps_and_releases_run_on_the_main_thread_and_sigterm_drains(caplog) -> None:
    port = free_port()
    config = WorkerConfig(port=port, metrics_port=0, num_blocks=64, block_size=16)
    cfg, engine = build_engine(config)
    threads: list[str] = []
    step, release = engine.step, engine.release

    def on_step(*a, **kw):
        threads.append(threading.current_thread().name)
        return step(*a, **kw)

    def on_release(ids):
        threads.append(threading.current_thread().name)
        return release(ids)

    engine.step, engine.release = on_step, on_release  # type: ignore[method-assign]
    results: dict[str, object] = {}

    def client() -> None:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                grpc.channel_ready_future(ch).result(timeout=30)
                stub = wpb_grpc.WorkerStub(ch)
                prompt = [(7 * i + 3) % cfg.vocab_size for i in range(20)]
                got = []
                for sid in ("a", "b"):
                    r = stub.Step(
                        wpb.StepRequest(prefill=[wpb.PrefillItem(session_id=sid, token_ids=prompt, last_chunk=True)]),
                        timeout=30,
                    )
                    got.append(r.results[0].token_id)
                r = stub.Step(
                    wpb.StepRequest(
                        decode=[wpb.DecodeItem(session_id="b", token_id=got[1], position=20, generated_so_far=1)],
                        release_session_ids=["a"],
                    ),
                    timeout=30,
                )
                results["decoded"] = r.results[0].status == wpb.ITEM_OK
                results["released"] = stub.Release(wpb.ReleaseRequest(session_ids=["b"]), timeout=30).released
                results["same_token"] = got[0] == got[1]
        except Exception as exc:  # reported by the assertions below
            results["error"] = exc
        finally:
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)  # the worker's drain, as a supervisor sends it

    t = threading.Thread(target=client, name="test-client")
    t.start()
    previous = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.INFO, logger="worker_svc.server"):
        serve_on_compute_thread(config, (cfg, engine))  # returns after the drain
    t.join()
    assert "error" not in results, results.get("error")
    assert results == {"decoded": True, "released": 1, "same_token": True}
    assert threads and set(threads) == {threading.main_thread().name}  # 3 steps, a release in one, a Release
    assert len(threads) == 5
    assert signal.getsignal(signal.SIGTERM) == previous  # handlers given back
    # The start line says which ops the CPU forward uses (README: "Faster CPU modes").
    fused_on = engine.model.fused is not None
    assert f"fused CPU ops {'on' if fused_on else 'off'}" in caplog.text
    assert "draining" in caplog.text

"""A worker reports its resident memory (GetStats, the scheduler's ListWorkers, `kvfleet
workers`, Prometheus), its weights live once, and at idle its RSS stays within issue 25's bound."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvfleet.cli import main as cli_main
from kvfleet.client import SchedulerClient
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet_models.config import tiny_config
from kvfleet_models.tiny import tiny_weights
from tests.helpers.models import SMOLLM2, needs_smollm2
from tests.helpers.worker_stats import wait_for_worker_stats, worker_stats
from worker_svc.memory import RSS_HEADROOM_BYTES
from worker_svc.model import fused
from worker_svc.model.llama import LlamaModel
from worker_svc.runner import RunItem


def test_resident_memory_is_reported_by_the_worker_and_the_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    with LocalCluster(ClusterSpec(workers=1, model="tiny", telemetry=False, num_blocks=64)) as cluster:
        (address,) = cluster.worker_addresses
        rss = worker_stats(address).rss_bytes
        assert 50e6 < rss < 8e9, rss  # a Python process with torch loaded, nowhere near 8 GB
        with SchedulerClient(cluster.scheduler_address) as client:
            (w,) = client.list_workers()  # read by the scheduler's first stats poll, at start
        assert 0.5 * rss < w.rss_bytes < 2 * rss, (w.rss_bytes, rss)
        wait_for_worker_stats(address, lambda s: s.rss_bytes > 0, what="a second reading")
        # `kvfleet workers` prints it beside issue 25's bound.
        cli_main(["workers", "--scheduler", cluster.scheduler_address])
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    sizes = ("kv_bytes_per_token", "kv_capacity_tokens", "kv_pool_bytes", "rss_bound_bytes", "weight_bytes")
    assert all(type(row[k]) is int for k in (*sizes, "rss_bytes", "private_bytes")), row  # JSON numbers
    pool = row["kv_bytes_per_token"] * row["kv_capacity_tokens"]
    assert row["kv_pool_bytes"] == pool > 0
    assert row["rss_bound_bytes"] == row["weight_bytes"] + pool + RSS_HEADROOM_BYTES
    assert 0 < row["rss_bytes"] <= row["rss_bound_bytes"], row
    assert 0 < row["private_bytes"] <= row["rss_bytes"], row  # its own part, which the bound holds


def _logits(model: LlamaModel, threads: int) -> np.ndarray:
    from worker_svc.kv_cache import PagedKVCache, make_views
    from worker_svc.kv_views_mode import KVViewsMode
    from worker_svc.model.llama import PhaseTimes
    from worker_svc.runner import run_step

    cfg = model.cfg
    model.use_threads(threads)
    cache = PagedKVCache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    views = make_views(KVViewsMode.REBUILD, cache)
    # Two items of 5 tokens: 10 rows a product, within cpu_backend.TORCH_ROWS.
    items = [
        RunItem(f"s{i}", tuple(range(1 + i, 6 + i)), 0, tuple(range(16 * i, 16 * i + 5)), (i,), True) for i in range(2)
    ]
    return run_step(model, cache, views, items, PhaseTimes()).numpy()


def test_without_the_torch_copy_the_weights_live_once_and_the_products_agree() -> None:
    cfg = tiny_config()
    weights = tiny_weights(cfg, seed=0)
    cpu = torch.device("cpu")
    both = LlamaModel(cfg, weights, cpu, torch.float32, fused_ops=False)
    once = LlamaModel(cfg, weights, cpu, torch.float32, fused_ops=False, torch_copy=False)
    assert both.host_blas and once.host_blas
    for m in (mat for layer in once.layers for mat in layer.matrices()):
        assert m.nk.untyped_storage().data_ptr() == m.kn.untyped_storage().data_ptr()  # one copy
    for m in (mat for layer in both.layers for mat in layer.matrices()):
        assert m.nk.untyped_storage().data_ptr() != m.kn.untyped_storage().data_ptr()
    # Two threads: every product on the host BLAS, the same bits either way. One thread: 2-12
    # rows go to torch, which reads the one copy transposed: the same products, summed alike
    # up to rounding.
    assert np.array_equal(_logits(both, 2), _logits(once, 2))
    np.testing.assert_allclose(_logits(both, 1), _logits(once, 1), rtol=1e-5, atol=1e-5)


def test_the_kv_pool_sized_by_memory() -> None:
    from kvfleet.v1 import worker_pb2 as wpb
    from kvfleet.v1 import worker_pb2_grpc as wpb_grpc

    spec = ClusterSpec(workers=1, model="tiny", telemetry=False, kv_cache_memory="8MiB")  # as kvfleet up passes it
    with LocalCluster(spec) as cluster:
        import grpc

        with grpc.insecure_channel(cluster.worker_addresses[0]) as ch:
            info = wpb_grpc.WorkerStub(ch).GetInfo(wpb.GetInfoRequest(), timeout=10)
        assert info.num_blocks == 8 * 2**20 // (info.block_size * info.kv_bytes_per_token), info
        assert info.kv_capacity_tokens == info.num_blocks * info.block_size
        with SchedulerClient(cluster.scheduler_address) as client:
            assert client.list_workers()[0].kv_capacity_tokens == info.kv_capacity_tokens
        # The tiny model's steps are one C call each where the C ops build (README: whole steps).
        start = next(ln for ln in (cluster.log_dir / "worker-0.log").read_text().splitlines() if " serving " in ln)
        assert (", whole steps on, " in start) == (fused.load() is not None), start


@needs_smollm2
def test_a_real_worker_s_idle_memory_is_within_its_weights_pool_and_headroom(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25: a SmolLM2 worker process in each weight format, at idle, holds at most its
    weights in that format + its KV pool + RSS_HEADROOM_BYTES (no float copy beside packed
    weights, the load's buffers returned). Its start line names its formats, the kernels' level
    and the KV cache's type (README, "Faster CPU modes")."""
    from bench.memory import MODES, idle_memory
    from worker_svc.model import gguf_quant, q8

    monkeypatch.delenv(q8.LEVEL_ENV, raising=False)  # the workers pick their best level
    got = idle_memory(SMOLLM2, list(MODES), num_blocks=64)
    starts = {mode: m.start_line for mode, m in got.items()}
    best = {"int8": q8.runnable_levels()[-1], "gguf": gguf_quant.runnable_levels()[-1]}
    want = {
        "float32": "dtype float32, quant none, ",
        "bfloat16": "dtype bfloat16, quant none, ",
        "int8": f"dtype float32, quant int8 on {best['int8']} kernels, ",
        "gguf": f"dtype float32, quant gguf on {best['gguf']} kernels, ",
    }
    for mode, line in starts.items():
        assert want[mode] in line, (mode, line)
        kv = "float32" if mode == "float32" else "float16"  # --kv-dtype auto
        assert f" 64 {kv} KV blocks of 16" in line, (mode, line)
        assert ", whole steps off, " in line, (mode, line)  # SmolLM2's layers are past the limit
    for mode, m in got.items():
        assert m.within, f"{mode}: {m.row()}"
        assert 0 < m.private_bytes <= m.rss_bytes, m.row()
        # Tighter than the promise, so that a float copy beside packed weights (int8's 113 MB
        # tied head, say) fails: the worker's own memory beyond weights and pool measured
        # 236-245 MB in every mode (Intel Xeon, 2026-12-05).
        assert m.private_bytes <= m.weight_bytes + m.kv_pool_bytes + 300 * 10**6, f"{mode}: {m.row()}"
    # weight_bytes is the serving format's size, not the float checkpoint's.
    w = {mode: m.weight_bytes for mode, m in got.items()}
    assert w["gguf"] < w["int8"] < w["bfloat16"] < w["float32"], w
    # 64 blocks in every mode: float32 KV for float32 weights, float16 for the others (--kv-dtype auto)
    pool = {mode: m.kv_pool_bytes for mode, m in got.items()}
    assert pool["float32"] == 2 * pool["bfloat16"] == 2 * pool["int8"] == 2 * pool["gguf"] > 0, pool

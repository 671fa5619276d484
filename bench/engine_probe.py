"""The worker's engine alone, in this process: batch-1 decode and a prefill chunk, with no RPC
and no scheduler.

Batch-1 decode is the ceiling the cluster's concurrency-1 decode approaches. Both are measured
at each intra-op thread count tried: decode reads the weights (bandwidth-bound), a prefill chunk
multiplies by them (compute-bound, like a big batch), and on a shared machine a second thread
can help the one and wreck the other, so the harness picks the workers' threads from both.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvfleet_models.config import LlamaConfig
from kvfleet_models.gguf_blocks import BlockTensor
from worker_svc.engine import DecodeItem, Engine, EngineConfig, PrefillItem, SamplingSpec
from worker_svc.kv_views_mode import KVViewsMode
from worker_svc.local import LocalSteps
from worker_svc.model.cpu_backend import use_cpu_threads


def batch1_decode(
    cfg: LlamaConfig,
    weights: Mapping[str, np.ndarray | BlockTensor],
    device: str,
    dtype: str,
    kv_views: str,
    threads: Sequence[int],
    prompt_len: int = 256,
    steps: int = 20,
    budget_s: float = 4.0,
    quant: str = "none",
) -> dict:
    """Per thread count: decode tokens/s of one session after a ``prompt_len`` prompt, and
    that prompt's prefill tokens/s, in the workers' mode (``dtype``, ``quant``)."""
    engine = Engine(
        cfg,
        weights,
        EngineConfig(device=device, dtype=dtype, quant=quant, num_blocks=64, kv_views=KVViewsMode.parse(kv_views)),
    )
    # The blocks, chosen here as the scheduler would; no prefix cache: every thread count's
    # prefill runs the same prompt, which must be computed each time, not found cached.
    driver = LocalSteps(engine, prefix_caching=False)
    greedy = SamplingSpec()
    prompt = tuple(int(t) for t in np.random.default_rng(1).integers(100, cfg.vocab_size, prompt_len))
    saved = torch.get_num_threads()
    out: dict[str, float] = {}
    prefill: dict[str, float] = {}
    driver.step([PrefillItem("warm", prompt[:16], 0, True, greedy)], [])  # first-call costs
    driver.release(["warm"])
    try:
        for n in threads if engine.device.type == "cpu" else [saved]:
            if engine.device.type == "cpu":
                use_cpu_threads(n, engine.model.host_blas, engine.model)
            # The faster of two prefills: the first at a thread count may pay one-time costs
            # (a pool's threads starting, oneDNN's kernels for a new shape). One disturbed
            # reading (bfloat16 at 2 threads: 936 tok/s against 1,740) gave a mode 1 thread.
            best = 0.0
            for _ in range(2):
                driver.release(["probe"])
                t0 = time.perf_counter()
                token = driver.step([PrefillItem("probe", prompt, 0, True, greedy)], []).results[0].token_id
                assert token is not None, "a last prefill chunk returns a token"
                best = max(best, prompt_len / (time.perf_counter() - t0))
            prefill[str(n)] = round(best, 1)
            assert token is not None
            times: list[float] = []
            end = time.perf_counter() + budget_s  # a thread count that stalls is cut short
            for k in range(steps):
                t0 = time.perf_counter()
                res = driver.step([], [DecodeItem("probe", int(token), prompt_len + k, greedy, k + 1)])
                times.append(time.perf_counter() - t0)
                token = res.results[0].token_id
                assert token is not None, "a decode step returns a token"
                if t0 > end and len(times) >= 5:
                    break
            # The median step: robust to the other tenants of a shared machine.
            out[str(n)] = round(1.0 / float(np.median(times[2:])), 2)
    finally:
        if engine.device.type == "cpu":
            use_cpu_threads(1, engine.model.host_blas, engine.model)
        torch.set_num_threads(saved)
    return {
        "weight_bytes": engine.weight_bytes,  # what a batch-1 step reads: the roofline's bytes
        "kv_block_bytes": engine.cache.kv.nbytes // engine.config.num_blocks,
        "tok_s_by_threads": out,
        "best_tok_s": max(out.values()),
        "prompt_len": prompt_len,
        "prefill_tok_s_by_threads": prefill,
        "kv_views": kv_views,
    }

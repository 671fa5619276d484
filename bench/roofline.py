"""The machine's limits, measured now: memory bandwidth and matmul FLOP/s, and the bounds they
put on decoding a model.

- bandwidth: a float32 matrix-vector product over a matrix far larger than the caches; it
  reads every weight once, as batch-1 decoding does (GB/s = matrix bytes / time). On a CPU
  with both torch's BLAS (MKL) and numpy's (OpenBLAS, which the worker uses for float32), in
  both matrix layouts, so the bound is the best either library reaches;
- FLOP/s: a large float32 matrix-matrix product (2 n^3 / time); TF32 is switched off on CUDA so
  the figure is float32's.

Each is the best of a few repeats at each thread count tried (best, not mean: the machine is
shared, and the bound is what it can do). Derived: batch-1 decode bound = bandwidth / bytes of
weights read per token; compute bound at large batch = FLOP/s / (2 x matmul parameters).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvfleet_models.config import LlamaConfig

try:
    from worker_svc.model.cpu_backend import set_host_blas_threads
except ImportError:  # the harness also measures old trees: the setter lived in the model, or nowhere
    try:
        from worker_svc.model.llama import set_host_blas_threads  # type: ignore[no-redef,attr-defined]
    except ImportError:

        def set_host_blas_threads(n: int) -> bool:  # type: ignore[misc]
            return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _over_threads(device: torch.device, threads: Sequence[int], measure: Callable[[], float]) -> dict:
    if device.type != "cpu":
        return {"best": measure(), "by_threads": {}}
    saved = torch.get_num_threads()
    by = {}
    try:
        for n in threads:
            torch.set_num_threads(n)
            set_host_blas_threads(n)
            by[str(n)] = measure()
    finally:
        torch.set_num_threads(saved)
        set_host_blas_threads(1)
    return {"best": max(by.values()), "by_threads": by}


def memory_bandwidth_gbs(device: torch.device, threads: Sequence[int], repeats: int = 8) -> dict:
    n = 16384 if device.type == "cuda" else 8192  # 1 GiB on a GPU, 256 MiB on a CPU
    w = torch.randn(n, n, device=device)
    x = torch.randn(n, device=device)
    gb = w.numel() * 4 / 1e9
    kernels: list[Callable[[], object]] = [lambda: torch.mv(w, x)]
    if device.type == "cpu":
        wn, xn = w.numpy(), x[None].numpy()
        kernels += [lambda: np.matmul(xn, wn), lambda: np.matmul(wn, xn[0])]

    def measure() -> float:
        return max(gb / _best_time(k, device, repeats) for k in kernels)

    return _over_threads(device, threads, measure)


def matmul_gflops(device: torch.device, threads: Sequence[int], repeats: int = 4) -> dict:
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:

        def measure() -> float:
            return 2 * n**3 / _best_time(lambda: a @ b, device, repeats) / 1e9

        return _over_threads(device, threads, measure)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32


def matmul_params(cfg: LlamaConfig) -> int:
    """Weights a decoded token multiplies: every layer's projections and the LM head (the
    embedding is a lookup of one row; norms are negligible but counted)."""
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = (
        cfg.hidden_size * (hq + 2 * hkv) * d
        + hq * d * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
        + 2 * cfg.hidden_size
    )
    return cfg.num_layers * per_layer + cfg.hidden_size + cfg.vocab_size * cfg.hidden_size


def decode_bounds(cfg: LlamaConfig, bytes_per_param: int, bandwidth_gbs: float, gflops: float) -> dict:
    params = matmul_params(cfg)
    weight_bytes = params * bytes_per_param
    return {
        "matmul_params": params,
        "weight_bytes_per_token": weight_bytes,
        "batch1_decode_bound_tok_s": round(bandwidth_gbs * 1e9 / weight_bytes, 2),
        "flop_per_token": 2 * params,
        "compute_bound_tok_s": round(gflops * 1e9 / (2 * params), 1),
    }

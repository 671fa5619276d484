"""The KV cache's element type (``--kv-dtype``, ``platform.kv_cache_dtype``): float32 for the
float32 mode, float16 for the reduced-precision CPU modes by default, the weights' dtype off a
CPU. Here: the rule and its refusals, the pool sized in the cache's own bytes, what a float16
cache costs against a float32 one in the same engine (the stored K/V is rounded once, nothing
else changes), and GetInfo. Quality on the real model with each mode's default KV:
``test_quant_quality.py``; the C attention on float16 K/V: ``test_fused_ops.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfleet_models.tiny import tiny_weights
from tests.unit.model_configs import GQA_CFG
from worker_svc.config import WorkerConfig
from worker_svc.convert import info_to_pb
from worker_svc.engine import DecodeItem, Engine, EngineConfig, PrefillItem, SamplingSpec
from worker_svc.local import LocalSteps
from worker_svc.platform import kv_cache_dtype
from worker_svc.server import build_engine

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
WEIGHTS = tiny_weights(GQA_CFG, seed=3)
GREEDY = SamplingSpec()


@pytest.mark.parametrize(
    "device, dtype, quant, asked, want",
    [
        (CPU, torch.float32, "none", "auto", torch.float32),  # the exact mode keeps float32
        (CPU, torch.float32, "int8", "auto", torch.float16),
        (CPU, torch.float32, "gguf", "auto", torch.float16),
        (CPU, torch.bfloat16, "none", "auto", torch.float16),
        (CPU, torch.float32, "none", "float16", torch.float16),
        (CPU, torch.float32, "gguf", "float32", torch.float32),
        (CUDA, torch.bfloat16, "none", "auto", torch.bfloat16),  # the weights' dtype off a CPU
        (CUDA, torch.float16, "none", "float16", torch.float16),
    ],
)
def test_the_kv_dtype_rule(device, dtype, quant, asked, want) -> None:
    assert kv_cache_dtype(device, dtype, quant, asked) == want


def test_what_no_backend_keeps_is_refused_with_what_to_use() -> None:
    with pytest.raises(
        ValueError, match="kv dtype float16 on cuda: the KV cache there is the weights' dtype .bfloat16.; use auto"
    ):
        kv_cache_dtype(CUDA, torch.bfloat16, "none", "float16")
    with pytest.raises(ValueError, match="kv dtype must be one of auto, float32, float16, got 'int8'"):
        kv_cache_dtype(CPU, torch.float32, "none", "int8")
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, float32, float16, got 'half'"):
        EngineConfig(kv_dtype="half")
    with pytest.raises(ValueError, match="kv dtype must be one of auto, float32, float16, got 'fp8'"):
        WorkerConfig(kv_dtype="fp8")
    # a worker's flags are refused before its model loads
    with pytest.raises(ValueError, match="kv dtype float16 on cuda:1: .* weights' dtype .bfloat16.; use auto"):
        WorkerConfig(device="cuda:1", dtype="bfloat16", kv_dtype="float16")
    assert WorkerConfig(device="cuda", dtype="float16", kv_dtype="float16").kv_dtype == "float16"


def _steps(engine: Engine) -> tuple[np.ndarray, list[int]]:
    """A prefill of two prompts in one step, then 6 decodes of both: the logits of every step
    and the greedy tokens."""
    steps = LocalSteps(engine)
    v = GQA_CFG.vocab_size
    prompts = {"a": tuple((7 * i + 3) % v for i in range(37)), "b": tuple((5 * i + 1) % v for i in range(11))}
    out = steps.step([PrefillItem(s, p, 0, True, GREEDY) for s, p in prompts.items()], [], return_logits=True)
    assert all(r.token_id is not None for r in out.results)
    rows, tokens = [out.logits], [r.token_id for r in out.results]
    last = {r.session_id: r.token_id for r in out.results}
    for k in range(6):
        decode = [DecodeItem(s, last[s], len(p) + k, GREEDY, k + 1) for s, p in prompts.items()]
        out = steps.step([], decode, return_logits=True)
        rows.append(out.logits)
        last = {r.session_id: r.token_id for r in out.results}
        tokens += [r.token_id for r in out.results]
    return np.concatenate(rows), tokens


@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
@pytest.mark.parametrize("fused_ops", [True, False], ids=["fused", "torch-ops"])
def test_a_float16_cache_costs_one_rounding_of_the_stored_kv(kv_views: str, fused_ops: bool) -> None:
    """The same float32 engine with either cache: half the bytes a token, and logits apart by
    about what rounding K and V to float16 (2^-11 relative) gives, far less than a wrong read
    (a K/V element read at the wrong place or width moves them by the whole spread). Measured
    here: at most 9e-5 of the spread."""
    runs = {}
    for kv_dtype in ("float32", "float16"):
        engine = Engine(
            GQA_CFG,
            WEIGHTS,
            EngineConfig(block_size=4, num_blocks=64, kv_views=kv_views, fused_ops=fused_ops, kv_dtype=kv_dtype),
        )
        assert engine.cache.kv.dtype == getattr(torch, kv_dtype)
        runs[kv_dtype] = (engine.kv_bytes_per_token, *_steps(engine))
    (bytes32, ref, tokens32), (bytes16, got, tokens16) = runs["float32"], runs["float16"]
    assert bytes16 * 2 == bytes32
    spread = float(ref.max() - ref.min())
    assert 0 < np.abs(got - ref).max() < 2e-3 * spread  # rounded (not equal), and only rounded
    assert tokens16 == tokens32


def test_the_pool_is_sized_in_the_caches_own_bytes() -> None:
    """--kv-cache-memory buys twice the blocks with a float16 cache; GetInfo names the type."""
    blocks = {}
    for kv_dtype in ("float32", "float16"):
        config = WorkerConfig(model="tiny", kv_cache_memory="4MiB", kv_dtype=kv_dtype, metrics_port=0)
        cfg, engine = build_engine(config)
        block_bytes = engine.kv_bytes_per_token * engine.config.block_size
        assert engine.config.num_blocks == 4 * 2**20 // block_bytes  # as many as fit
        blocks[kv_dtype] = engine.config.num_blocks
        info = info_to_pb("w", cfg, engine, engine.config.block_size, engine.config.num_blocks, "i")
        assert (info.kv_dtype, info.kv_bytes_per_token) == (kv_dtype, engine.kv_bytes_per_token)
    assert blocks["float16"] in (2 * blocks["float32"], 2 * blocks["float32"] + 1)

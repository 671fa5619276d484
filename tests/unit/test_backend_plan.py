"""The backend plan (worker_svc/platform.py): what a model runs with on each device and mode,
decided once, and the combinations no backend runs refused with a message."""

from __future__ import annotations

import pytest
import torch

from kvfleet_models.config import tiny_config
from kvfleet_models.tiny import tiny_weights
from worker_svc.model.llama import LlamaModel
from worker_svc.platform import plan_backend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16 = torch.float32, torch.bfloat16

# (device, dtype, quant, host_blas) -> (act dtype, host BLAS, host attention, oneDNN bf16, fused)
CASES = [
    ((CPU, F32, "none", None), (F32, True, True, False, True)),
    ((CPU, F32, "int8", None), (F32, False, True, False, True)),
    ((CPU, BF16, "none", None), (F32, False, True, True, True)),
    ((CPU, F32, "none", False), (F32, False, False, False, True)),  # the GPU path, on a CPU
    ((CPU, BF16, "none", False), (F32, False, False, False, True)),
    ((CUDA, BF16, "none", None), (BF16, False, False, False, False)),
    ((CUDA, F32, "none", None), (F32, False, False, False, False)),
]


@pytest.mark.parametrize("args,want", CASES, ids=[f"{a[0].type}-{a[1]}-{a[2]}-{a[3]}" for a, _ in CASES])
def test_the_plan_for_each_device_and_mode(args, want) -> None:
    p = plan_backend(*args)
    assert (p.act_dtype, p.host_blas, p.host_attention, p.onednn_bf16, p.fused_ops) == want
    assert p.on_cpu == (args[0].type == "cpu")


def test_fused_ops_off_is_honoured_and_impossible_modes_are_refused() -> None:
    assert not plan_backend(CPU, F32, fused_ops=False).fused_ops
    with pytest.raises(ValueError, match="quant=int8 needs float32 on a CPU"):
        plan_backend(CUDA, F32, "int8")
    with pytest.raises(ValueError, match="quant=int8 needs float32 on a CPU"):
        plan_backend(CPU, BF16, "int8")
    with pytest.raises(ValueError, match="host_blas needs float32 weights on a CPU"):
        plan_backend(CPU, BF16, host_blas=True)


@pytest.mark.parametrize("dtype,host_blas", [(F32, None), (BF16, None), (F32, False)])
def test_the_model_runs_what_its_plan_says(dtype, host_blas) -> None:
    cfg = tiny_config()
    model = LlamaModel(cfg, tiny_weights(cfg, seed=0), CPU, dtype, host_blas=host_blas)
    p = model.plan
    assert (model.act_dtype, model.host_blas, model.host_attention) == (p.act_dtype, p.host_blas, p.host_attention)
    assert p == plan_backend(CPU, dtype, "none", host_blas)
    layer = model.layers[0]
    # Host BLAS keeps the [in, out] copy it multiplies by; the torch path only [out, in].
    assert (layer.qkv.kn is not None) == p.host_blas
    # ... which numpy reads through a view made once, of the same memory (no second copy).
    if p.host_blas:
        assert layer.qkv.kn_array is not None and layer.qkv.kn_array.base is not None
        assert layer.qkv.kn_array.ctypes.data == layer.qkv.kn.data_ptr()
    else:
        assert layer.qkv.kn_array is None

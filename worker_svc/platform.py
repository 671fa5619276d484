"""The torch devices a worker can run on: naming, checking and waiting for one, and the backend
plan a model runs with there (dtypes, which BLAS, which kernels).

One place for what differs between cpu, cuda and xpu, so that a device that is not there is a
one-line error naming those that are, not a traceback from deep in the engine, and the model
reads choices rather than branching on the device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from worker_svc.kv_memory import KV_DTYPES

DEVICE_RE = re.compile(r"^(cpu|auto|xpu|cuda|cuda:\d+|xpu:\d+)$")


def _xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def available_devices() -> list[str]:
    """The devices torch sees in this process, e.g. ["cpu", "cuda:0", "cuda:1"]."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if _xpu_available():
        found += [f"xpu:{i}" for i in range(torch.xpu.device_count())]
    return found


def resolve_device(name: str) -> torch.device:
    """The device ``name`` means here ("auto": cuda, then xpu, then cpu); ValueError, naming the
    devices torch sees, for one that is not there."""
    if not DEVICE_RE.match(name):
        raise ValueError(f"device must be cpu, cuda, cuda:N, xpu, xpu:N or auto, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "xpu" if _xpu_available() else "cpu")
    seen = available_devices()
    kind, _, index = name.partition(":")
    if kind != "cpu" and not any(d.startswith(kind + ":") for d in seen):
        raise ValueError(
            f"device {name!r}: this torch ({torch.__version__}) sees no {kind} device; "
            f"devices here: {', '.join(seen)} (or --device auto)"
        )
    if index and f"{kind}:{index}" not in seen:
        raise ValueError(f"device {name!r} is not there; devices here: {', '.join(seen)}")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (a no-op on cpu, where ops run eagerly)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # --dtype


def kv_cache_dtype(
    device: torch.device, dtype: torch.dtype, quant: str = "none", kv_dtype: str = "auto"
) -> torch.dtype:
    """The KV cache's element type. On a CPU the activations are float32 whatever the weights;
    "auto" keeps the KV float32 for float32 weights (the exact mode, held to transformers) and
    stores float16 for the reduced-precision ones (bfloat16 weights, int8, gguf; llama.cpp's
    default KV type too): the decode attention widens it as it reads (``fused``), and its
    bytes, which a batch-32 decode step streams once per layer, halve. Off a CPU the KV is the
    activations' dtype, the only one torch's attention path there takes. ValueError for a
    choice that is not one, or that this device cannot keep."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if device.type != "cpu":
        if kv_dtype != "auto" and DTYPES[kv_dtype] != dtype:
            raise ValueError(
                f"kv dtype {kv_dtype} on {device.type}: the KV cache there is the weights' dtype "
                f"({str(dtype).removeprefix('torch.')}); use auto"
            )
        return dtype
    if kv_dtype == "auto":
        return torch.float32 if dtype == torch.float32 and quant == "none" else torch.float16
    return DTYPES[kv_dtype]


@dataclass(frozen=True)
class BackendPlan:
    """Which kernels and dtypes a model runs with on its device: decided once, here, from the
    device and the modes asked for, so that the model reads choices instead of branching on
    ``device.type``. On a CPU the activations (residual stream, norms, attention) are float32
    whatever the weights; elsewhere they are the weights' dtype. (The KV cache's type:
    ``kv_cache_dtype``.)"""

    device: torch.device
    weight_dtype: torch.dtype
    act_dtype: torch.dtype
    host_blas: bool  # the products on numpy's BLAS (float32 weights on a CPU, not int8)
    host_attention: bool  # attention's batched products on numpy's BLAS (every CPU path)
    onednn_bf16: bool  # bfloat16 weights on a CPU: oneDNN's packed copies where it has them
    fused_ops: bool  # try the hand-fused C ops (float32 CPU tensors only)
    quant: str  # "none" | "int8"

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"


def plan_backend(
    device: torch.device,
    dtype: torch.dtype,
    quant: str = "none",
    host_blas: bool | None = None,
    fused_ops: bool | None = None,
) -> BackendPlan:
    """host_blas: None = numpy's BLAS exactly when float32 on a CPU; False forces torch's path,
    which GPUs take (so that a CPU-only test can check it). fused_ops: False = torch's ops only.
    ValueError for a combination no backend runs (int8 or host_blas off a float32 CPU)."""
    on_cpu = device.type == "cpu"
    cpu_f32 = on_cpu and dtype == torch.float32
    if quant != "none" and (not cpu_f32 or host_blas):
        raise ValueError(f"quant={quant} needs float32 on a CPU (and not host_blas); got {device}, {dtype}")
    if host_blas and not cpu_f32:
        raise ValueError("host_blas needs float32 weights on a CPU")
    blas = (cpu_f32 and quant == "none") if host_blas is None else host_blas
    return BackendPlan(
        device=device,
        weight_dtype=dtype,
        act_dtype=torch.float32 if on_cpu else dtype,
        host_blas=blas,
        host_attention=blas or (on_cpu and host_blas is None),
        onednn_bf16=on_cpu and dtype == torch.bfloat16 and host_blas is None,
        fused_ops=fused_ops is not False and on_cpu,
        quant=quant,
    )

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


@dataclass(frozen=True)
class BackendPlan:
    """Which kernels and dtypes a model runs with on its device: decided once, here, from the
    device and the modes asked for, so that the model reads choices instead of branching on
    ``device.type``. On a CPU the activations (residual stream, norms, attention, the KV cache)
    are float32 whatever the weights; elsewhere they are the weights' dtype."""

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

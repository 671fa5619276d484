"""The torch devices a worker can run on: naming, checking and waiting for one.

One place for what differs between cpu, cuda and xpu at the process level, so that a device that
is not there is a one-line error naming those that are, not a traceback from deep in the engine.
"""

from __future__ import annotations

import re

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

"""Device naming and checking (worker_svc/platform.py): what a worker says about --device."""

from __future__ import annotations

import pytest
import torch

from worker_svc import platform


def test_cpu_and_auto_resolve_here() -> None:
    assert platform.resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "xpu" if platform._xpu_available() else "cpu"
    assert platform.resolve_device("auto").type == expected
    assert platform.available_devices()[0] == "cpu"


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "CPU", ""])
def test_a_malformed_name_says_what_is_accepted(name: str) -> None:
    with pytest.raises(ValueError, match="cpu, cuda, cuda:N, xpu, xpu:N or auto"):
        platform.resolve_device(name)


def test_a_missing_device_names_the_ones_torch_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a machine with two GPUs: cuda:1 is there, cuda:2 and any xpu are not.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(platform, "_xpu_available", lambda: False)
    assert platform.available_devices() == ["cpu", "cuda:0", "cuda:1"]
    assert platform.resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"'cuda:2' is not there; devices here: cpu, cuda:0, cuda:1"):
        platform.resolve_device("cuda:2")
    with pytest.raises(ValueError, match=r"sees no xpu device; devices here: cpu, cuda:0, cuda:1"):
        platform.resolve_device("xpu")

"""A worker given a bad model file says which file and what is wrong, and exits non-zero."""

import subprocess
import sys
from pathlib import Path

import pytest


def _start(model: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker_svc", "--model", model, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "no such file"),
        (b"garbage bytes, not a model", "not a GGUF file"),
    ],
)
def test_bad_model_file_is_a_clear_startup_error(tmp_path: Path, content, problem):
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    proc = _start(str(path))
    assert proc.returncode != 0
    assert str(path) in proc.stderr and problem in proc.stderr
    assert "Traceback" not in proc.stderr


def test_truncated_real_model_is_a_clear_startup_error(tmp_path: Path):
    from kvfleet_models.registry import default_model_file

    src = default_model_file("smollm2-135m")
    path = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        path.write_bytes(f.read(5_000_000))
    proc = _start(str(path))
    assert proc.returncode != 0 and str(path) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_model_name_lists_the_known_ones():
    proc = _start("gpt-17")
    assert proc.returncode != 0 and "smollm2-135m" in proc.stderr and "tiny" in proc.stderr


@pytest.mark.parametrize("module", ["scheduler_svc", "worker_svc", "telemetry_svc", "gateway_svc"])
def test_config_file_with_an_unknown_key_names_it(tmp_path: Path, module):
    config = tmp_path / "svc.toml"
    config.write_text('log-format = "json"\nmax-runing = 4\n')
    proc = subprocess.run(
        [sys.executable, "-m", module, "--config", str(config)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "unknown key 'max-runing'" in proc.stderr and str(config) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_environment_value_names_the_variable():
    import os

    proc = subprocess.run(
        [sys.executable, "-m", "worker_svc", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KVFLEET_NUM_BLOCKS": "lots"},
    )
    assert proc.returncode == 2 and "KVFLEET_NUM_BLOCKS" in proc.stderr and "'lots'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("device", ["xpu", "cuda:7"])
def test_a_device_that_is_not_there_is_one_line_naming_those_that_are(device: str):
    import torch

    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    proc = subprocess.run(
        [sys.executable, "-m", "worker_svc", "--model", "tiny", "--port", "0", "--device", device],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and device in lines[0] and "devices here: cpu" in lines[0], proc.stderr

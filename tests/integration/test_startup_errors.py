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


@pytest.fixture
def held_port():
    """A port another program listens on."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _one_line(proc: subprocess.CompletedProcess, prefix: str) -> str:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    "module, args, flag",
    [
        ("telemetry_svc", ["--db", "{tmp}/t.db", "--port", "{held}"], "--port"),
        ("telemetry_svc", ["--db", "{tmp}/t.db", "--port", "{held}", "--host", "localhost"], "--port"),
        # Checked before it waits (up to a minute) for workers that are not there.
        ("scheduler_svc", ["--model", "tiny", "--workers", "127.0.0.1:1", "--port", "{held}"], "--port"),
        (
            "scheduler_svc",
            ["--model", "tiny", "--workers", "127.0.0.1:1", "--port", "0", "--metrics-port", "{held}"],
            "--metrics-port",
        ),  # fmt: skip
        ("worker_svc", ["--model", "tiny", "--port", "{held}"], "--port"),
        ("worker_svc", ["--model", "tiny", "--port", "0", "--metrics-port", "{held}"], "--metrics-port"),
        ("gateway_svc", ["--port", "{held}"], "--port"),
    ],
)
def test_a_service_on_a_taken_port_says_so_in_one_line(module, args, flag, held_port, tmp_path):
    """grpc's own error was a traceback ending in "Failed to bind to address"; the gateway's an
    OSError line without the flag; a scheduler said nothing until its workers had answered."""
    argv = [a.format(held=held_port, tmp=tmp_path) for a in args]
    proc = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=60)
    name = module.removesuffix("_svc")
    line = _one_line(proc, f"{name}: ")
    assert "cannot listen on " in line and f":{held_port} (" in line, line
    assert "the port is in use" in line and line.endswith(f"choose another with {flag}"), line


def test_kvfleet_up_checks_its_ports_before_starting_anything(held_port, tmp_path):
    """A second `kvfleet up` (its telemetry port taken) used to start its workers, then print the
    telemetry service's traceback; now it names the port and up's flag at once."""
    from kvfleet.local_cluster import free_port

    cmd = [sys.executable, "-m", "kvfleet.cli", "up", "--model", "tiny", "--workers", "1", "--port", str(free_port()),
           "--telemetry-port", str(held_port), "--trace-api-port", str(free_port()),
           "--gateway-port", str(free_port())]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    line = _one_line(proc, "kvfleet: ")
    assert line == (
        f"kvfleet: cannot listen on 127.0.0.1:{held_port} (telemetry's OTLP): the port is in use (another kvfleet "
        "service, or a second `kvfleet up`?); free it or choose another with --telemetry-port"
    )
    assert "pids:" not in proc.stdout + proc.stderr  # nothing was started


def test_a_worker_refuses_a_taken_port_before_it_imports_torch(held_port):
    """The port check came after torch's import, so the one line came about 2 s late; now nothing
    that imports torch has run when the worker names the port (-X importtime lists every import)."""
    cmd = [sys.executable, "-X", "importtime", "-m", "worker_svc", "--model", "tiny", "--port", str(held_port)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    line = _one_line(proc, "worker: ")
    assert f":{held_port} (" in line and line.endswith("choose another with --port"), line
    imported = [ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")]
    assert "socket" in imported, proc.stderr[-2000:]  # the listing is there (the check uses it)
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")], "torch was imported first"

"""The pure cores stay mypy-clean (the style guide's promise, checked rather than hoped)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORES = [
    "scheduler_svc/core",
    "worker_svc/block_allocator.py",
    "telemetry_svc/stats.py",
    "telemetry_svc/gates.py",
    "telemetry_svc/summary.py",
    "gateway_svc/openai_schema.py",
    "gateway_svc/openai_responses.py",
    "gateway_svc/tool_calls.py",
    "worker_svc/sampling.py",
]


def test_cores_are_mypy_clean():
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--no-incremental", *CORES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

"""The CLI as a user runs it: a local cluster of real processes, the sweep, the JSON file."""
import json
import subprocess
import sys
from pathlib import Path


def test_sweep_cli_starts_a_cluster_and_writes_the_json(tmp_path: Path):
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, "-m", "kvfleet.cli", "sweep", "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["concurrency_sweep"]["corruption_free"] is True
    assert [r["ticks"] for r in doc["concurrency_sweep"]["results"]] == [64, 33, 19, 15]
    assert "conc" in proc.stdout and "corruption_free: True" in proc.stdout


def test_generate_cli_against_a_running_cluster(cluster):
    proc = subprocess.run([sys.executable, "-m", "kvfleet.cli", "generate", "1,2,3", "--token-ids",
                           "--max-new-tokens", "5", "--json", "--scheduler", cluster.address],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["prompt_token_ids"] == [1, 2, 3] and len(doc["token_ids"]) == 5
    assert doc["finish_reason"] == "length"


def test_cli_reports_a_rejection_clearly(cluster):
    proc = subprocess.run([sys.executable, "-m", "kvfleet.cli", "generate", "1,2,3", "--token-ids",
                           "--max-new-tokens", "0", "--scheduler", cluster.address],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "INVALID_ARGUMENT" in proc.stderr and "max_new_tokens" in proc.stderr

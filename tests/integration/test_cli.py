"""The CLI as a user runs it: a local cluster of real processes, the sweep, the JSON file."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.images import png_size, svg_size


def test_sweep_cli_starts_a_cluster_and_writes_the_json(tmp_path: Path):
    out = tmp_path / "sweep.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvfleet.cli", "sweep", "--out", str(out)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["concurrency_sweep"]["corruption_free"] is True
    assert [r["ticks"] for r in doc["concurrency_sweep"]["results"]] == [64, 33, 19, 15]
    # The reference example's KV budget, given to this cluster's scheduler (the default is the
    # workers' caches), so the snapshot's budget and pressure read as the example's do.
    snap = doc["mid_run_telemetry_concurrency_4"]
    assert snap["kv_budget_bytes"] == 64 * 1024 * 1024
    assert snap["kv_pressure"] == round(snap["kv_total_bytes"] / (64 * 1024 * 1024), 4)
    assert "conc" in proc.stdout and "corruption_free: True" in proc.stdout
    # Beside the JSON, its picture (tests/unit/test_plots.py checks the drawing itself).
    assert png_size(tmp_path / "sweep.png") == (1200, 400)
    assert svg_size(tmp_path / "sweep.svg") == ("864pt", "288pt")
    # stderr is a pipe here: plain progress lines, one per concurrency, no bar.
    steps = [line for line in proc.stderr.splitlines() if "] sweep " in line]
    assert [line.split("] sweep ")[1].split(" ")[0] for line in steps] == ["1/4", "2/4", "3/4", "4/4"], proc.stderr
    assert "eta" in steps[0] and "concurrency 8: 15 ticks" in steps[-1]
    assert "\r" not in proc.stderr


def test_version():
    from importlib.metadata import version

    proc = subprocess.run(
        [sys.executable, "-m", "kvfleet.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"kvfleet {version('kvfleet')}"
    assert version("kvfleet")[0].isdigit()


def test_up_config_file_unknown_key_is_named_before_anything_starts(tmp_path: Path):
    config = tmp_path / "up.yaml"
    config.write_text("workers: 1\nmodel: tiny\ngpus: 2\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvfleet.cli", "up", "--config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "unknown key 'gpus'" in proc.stderr and "starting" not in proc.stdout


def test_up_help_names_environment_variables():
    proc = subprocess.run(
        [sys.executable, "-m", "kvfleet.cli", "up", "--help"], capture_output=True, text=True, timeout=60
    )
    text = " ".join(proc.stdout.split())
    assert "--config FILE" in text and "[env KVFLEET_LOG_FORMAT]" in text and "[env KVFLEET_LOG_LEVEL]" in text


def test_generate_cli_against_a_running_cluster(cluster):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfleet.cli",
            "generate",
            "1,2,3",
            "--token-ids",
            "--max-new-tokens",
            "5",
            "--json",
            "--scheduler",
            cluster.address,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["prompt_token_ids"] == [1, 2, 3] and len(doc["token_ids"]) == 5
    assert doc["finish_reason"] == "length"


def test_cli_reports_a_rejection_clearly(cluster):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfleet.cli",
            "generate",
            "1,2,3",
            "--token-ids",
            "--max-new-tokens",
            "0",
            "--scheduler",
            cluster.address,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "INVALID_ARGUMENT" in proc.stderr and "max_new_tokens" in proc.stderr


def test_up_starts_int8_workers_when_asked(capsys, monkeypatch):
    # `kvfleet up --quant int8` reaches the workers (ClusterSpec.quant -> worker --quant), they
    # report it, the kernel level they picked at load and their KV's type (GetInfo -> ListWorkers
    # -> `kvfleet workers`), and they serve.
    from kvfleet.cli import main
    from kvfleet.client import SchedulerClient, build_request
    from kvfleet.local_cluster import ClusterSpec, LocalCluster
    from worker_svc.model import q8

    monkeypatch.delenv("KVFLEET_Q8_LEVEL", raising=False)  # the workers inherit the caller's
    level = q8.available_levels()[-1]  # what a worker picks by default
    with LocalCluster(ClusterSpec(workers=1, model="tiny", quant="int8", telemetry=False)) as c:
        with SchedulerClient(c.scheduler_address) as client:
            (w,) = client.list_workers()
            assert (w.dtype, w.quant, w.kernels, w.kv_dtype) == ("float32", "int8", level, "float16")
            assert len(client.generate(build_request([1, 2, 3], 5, ignore_eos=True)).token_ids) == 5
        capsys.readouterr()
        assert main(["workers", "--scheduler", c.scheduler_address]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (row["quant"], row["kernels"], row["kv_dtype"]) == ("int8", level, "float16")

"""`kvfleet up`'s cluster flags read the variables the services read for the same settings
(KVFLEET_MAX_RUNNING=3 is 3 under `kvfleet up` as under `python -m scheduler_svc`), below a flag
and a --config file; the processes it starts run what it found, not the caller's variable again;
the measurement commands, which share the flags, read no variable."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import scheduler_svc.__main__ as scheduler_main
import worker_svc.__main__ as worker_main
from kvfleet import local_cluster
from kvfleet.cli import _spec, build_parser
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from tests.helpers.environment import clear_kvfleet_env, no_service_logging

# (up's flag, its variable, the service whose same flag reads that variable, a value for the
# variable, the ClusterSpec field, what the field then holds): every cluster flag but --workers,
# whose count has no service variable (the scheduler's KVFLEET_WORKERS is a list of addresses).
CASES = [
    ("--model", "KVFLEET_MODEL", "worker", "smollm2-135m", "model", "smollm2-135m"),
    ("--device", "KVFLEET_DEVICE", "worker", "cuda:1", "device", "cuda:1"),
    ("--dtype", "KVFLEET_DTYPE", "worker", "bfloat16", "dtype", "bfloat16"),
    ("--quant", "KVFLEET_QUANT", "worker", "int8", "quant", "int8"),
    ("--max-running", "KVFLEET_MAX_RUNNING", "scheduler", "3", "max_running", 3),
    ("--prefill-token-budget", "KVFLEET_PREFILL_TOKEN_BUDGET", "scheduler", "128", "prefill_token_budget", 128),
    ("--kv-budget-bytes", "KVFLEET_KV_BUDGET_BYTES", "scheduler", "1048576", "kv_budget_bytes", 1048576),
    ("--overlap-scheduling", "KVFLEET_OVERLAP_SCHEDULING", "scheduler", "false", "overlap_scheduling", False),
    ("--step-stream", "KVFLEET_STEP_STREAM", "scheduler", "false", "step_stream", False),
    ("--step-spans", "KVFLEET_STEP_SPANS", "scheduler", "false", "step_spans", False),
    ("--num-blocks", "KVFLEET_NUM_BLOCKS", "worker", "32", "num_blocks", 32),
    ("--block-size", "KVFLEET_BLOCK_SIZE", "worker", "32", "block_size", 32),
    ("--kv-views", "KVFLEET_KV_VIEWS", "worker", "persistent", "kv_views", "persistent"),
    ("--threads", "KVFLEET_WORKER_THREADS", "worker", "2", "threads", 2),
    ("--kv-cache-memory", "KVFLEET_KV_CACHE_MEMORY", "worker", "64MiB", "kv_cache_memory", "64MiB"),
    ("--kv-dtype", "KVFLEET_KV_DTYPE", "worker", "float16", "kv_dtype", "float16"),
    ("--max-model-len", "KVFLEET_MAX_MODEL_LEN", "worker", "256", "max_model_len", 256),
]
MEASUREMENTS = ("sweep", "demo", "soak", "experiment")


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_kvfleet_env(monkeypatch)
    no_service_logging(monkeypatch)


def _help(parse: Callable[[list[str]], Any], argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        parse(argv)
    return capsys.readouterr().out


def _variables(help_text: str) -> dict[str, str | None]:
    """Each option's first long flag -> the variable its help names (None: none)."""
    entries: list[str] = []
    for line in help_text.splitlines():
        if line.startswith("  -"):
            entries.append(line)
        elif entries and line.startswith("   "):  # the entry's help, wrapped
            entries[-1] += " " + line.strip()
    out: dict[str, str | None] = {}
    for entry in entries:
        flag = re.search(r"--[\w-]+", entry)
        var = re.search(r"\[env (\w+)\]", entry)
        if flag:
            out[flag.group(0)] = var.group(1) if var else None
    return out


def _up(*argv: str) -> ClusterSpec:
    a = build_parser().parse_args(["up", *argv])
    return _spec(a, a.port)


def test_up_help_names_each_flags_variable_the_services_own(capsys: pytest.CaptureFixture[str]) -> None:
    up = _variables(_help(build_parser().parse_args, ["up", "--help"], capsys))
    service = {
        "scheduler": _variables(_help(scheduler_main.parse_args, ["--help"], capsys)),
        "worker": _variables(_help(worker_main.parse_args, ["--help"], capsys)),
    }
    for flag, variable, owner, *_ in CASES:
        assert up[flag] == variable, flag
        assert service[owner][flag] == variable, f"{owner} {flag}"
    assert up["--workers"] is None


@pytest.mark.parametrize("flag, variable, owner, value, field, want", CASES)
def test_up_reads_the_variable_below_a_flag_and_a_config_file(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    flag: str,
    variable: str,
    owner: str,
    value: str,
    field: str,
    want: Any,
) -> None:
    default = getattr(_up(), field)
    assert want != default
    monkeypatch.setenv(variable, value)
    assert getattr(_up(), field) == want
    if isinstance(want, bool):  # a switch: --name / --no-name
        on_command_line, in_file = [flag if default else f"--no-{flag[2:]}"], str(default).lower()
    else:
        on_command_line, in_file = [flag, str(default)], repr(default)
    assert getattr(_up(*on_command_line), field) == default  # the flag wins
    config = tmp_path / "up.toml"
    config.write_text(f"{flag[2:]} = {in_file}\n")
    assert getattr(_up("--config", str(config)), field) == default  # and so does the file


def test_several_variables_at_once_and_the_flag_still_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLEET_MAX_RUNNING", "3")
    monkeypatch.setenv("KVFLEET_STEP_SPANS", "false")
    spec = _up()
    assert (spec.max_running, spec.step_spans) == (3, False)
    spec = _up("--max-running", "5", "--step-spans")
    assert (spec.max_running, spec.step_spans) == (5, True)


def test_a_bad_value_of_a_variable_is_an_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVFLEET_MAX_RUNNING", "many")
    with pytest.raises(SystemExit):
        _up()
    assert "environment KVFLEET_MAX_RUNNING" in capsys.readouterr().err


@pytest.mark.parametrize("command", MEASUREMENTS)
def test_the_measurement_commands_read_no_variable(monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    """Their runs are their flags' (the demo's sweep is the reference run), whatever the shell holds."""
    before = _spec(build_parser().parse_args([command]))
    for _, variable, _, value, _, _ in CASES:
        monkeypatch.setenv(variable, value)
    assert _spec(build_parser().parse_args([command])) == before


class _Recorded:
    """Stands in for subprocess.Popen: keeps each process's arguments and environment."""

    started: list[tuple[list[str], dict[str, str]]] = []

    def __init__(self, args: list[str], env: dict[str, str], **_: Any) -> None:
        self.started.append((args, env))
        self.pid = 0

    def poll(self) -> None:
        return None


def _children(monkeypatch: pytest.MonkeyPatch, spec: ClusterSpec, log_dir: Path) -> dict[str, tuple[list, dict]]:
    """What LocalCluster would start for the spec: process name -> (its arguments, its environment)."""
    monkeypatch.setattr(_Recorded, "started", [])
    monkeypatch.setattr(local_cluster.subprocess, "Popen", _Recorded)
    monkeypatch.setattr(LocalCluster, "_wait_healthy", lambda self, addresses: None)
    log_dir.mkdir()
    cluster = LocalCluster(spec, log_dir=log_dir).start()
    return {name: (args, env) for name, (args, env) in zip(cluster.procs, _Recorded.started)}


def _as_started(monkeypatch: pytest.MonkeyPatch, child: tuple[list[str], dict[str, str]], parse: Callable) -> Any:
    """The config a service parses from its arguments under the environment it was given."""
    args, env = child
    for name in list(os.environ):
        if name.startswith("KVFLEET_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("KVFLEET_"):
            monkeypatch.setenv(name, value)
    return parse(args[3:])  # after: python -m package


# Settings LocalCluster passes no flag for where they are 0 or "": the service's own default.
UNSET_WHEN_ZERO = {
    "KVFLEET_MAX_MODEL_LEN": "2048",
    "KVFLEET_KV_CACHE_MEMORY": "64MiB",
    "KVFLEET_WORKER_THREADS": "3",
    "KVFLEET_KV_BUDGET_BYTES": "1048576",
}


def test_the_processes_run_what_up_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The variable once, in `kvfleet up`: its children get the result as a flag, or (where
    LocalCluster passes no flag) as their variable set to it, so a flag of up's still wins."""
    for name, value in {**UNSET_WHEN_ZERO, "KVFLEET_MAX_RUNNING": "3", "KVFLEET_STEP_SPANS": "false"}.items():
        monkeypatch.setenv(name, value)
    started = _children(monkeypatch, _up("--workers", "1"), tmp_path / "a")
    scheduler = _as_started(monkeypatch, started["scheduler"], scheduler_main.parse_args)
    worker = _as_started(monkeypatch, started["worker-0"], worker_main.parse_args)
    assert (scheduler.limits.max_running, scheduler.step_spans, scheduler.limits.kv_budget_bytes) == (3, False, 1048576)
    assert (worker.max_model_len, worker.kv_cache_memory, worker.num_threads) == (2048, "64MiB", 3)

    for name, value in UNSET_WHEN_ZERO.items():
        monkeypatch.setenv(name, value)  # _as_started cleared them
    zeros = ["--max-model-len", "0", "--kv-cache-memory", "", "--threads", "0", "--kv-budget-bytes", "0"]
    started = _children(monkeypatch, _up("--workers", "1", *zeros), tmp_path / "b")
    scheduler = _as_started(monkeypatch, started["scheduler"], scheduler_main.parse_args)
    worker = _as_started(monkeypatch, started["worker-0"], worker_main.parse_args)
    assert scheduler.limits.kv_budget_bytes == 0
    assert (worker.max_model_len, worker.kv_cache_memory, worker.num_threads) == (0, "", 0)

"""The README's CLI promises, run as a user runs them: `kvfleet demo` (what `make demo` runs),
`generate`/`chat` with their sampling, stop, EOS and deadline flags, `experiment` and `summary`,
`soak`, `telemetry` and `sweep --scheduler`. Each asserts what the user sees: the exit code,
stdout and stderr, the files written.

Most commands run in this process through `kvfleet.cli.main` (its return value is the exit
code: the entry point is `sys.exit(main())`); the demo and the deadline run as processes, the
demo through the installed `kvfleet` script that `make demo` runs."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfleet.cli import REFERENCE_KV_BUDGET_BYTES, main
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from tests.helpers.images import png_size, svg_size
from tests.helpers.models import needs_smollm2

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "concurrency_sweep_example.json"
PROMPT = "The capital of France is"


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str


def kvfleet(*argv: str) -> Run:
    """`kvfleet ARGV...` in this process: its exit code and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return Run(code, out.getvalue(), err.getvalue())


def _reference_results() -> list[dict]:
    return json.loads(REFERENCE.read_text())["concurrency_sweep"]["results"]


def _table_ticks(out: str) -> list[int]:
    """The ticks column of the sweep table printed on stdout."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["conc", "ticks"])
    rows = lines[head + 1 : head + 1 + len(_reference_results())]
    return [int(row.split()[1]) for row in rows]


def _assert_sweep_files(json_path: Path) -> dict:
    """The sweep's JSON equals the reference's results; its picture lies beside it."""
    doc = json.loads(json_path.read_text())
    assert doc["concurrency_sweep"]["corruption_free"] is True
    assert doc["concurrency_sweep"]["results"] == _reference_results()
    assert doc["mid_run_telemetry_concurrency_4"]["kv_budget_bytes"] == REFERENCE_KV_BUDGET_BYTES
    assert png_size(json_path.with_suffix(".png")) == (1200, 400)
    assert svg_size(json_path.with_suffix(".svg")) == ("864pt", "288pt")
    return doc


# ---------------------------------------------------------------- `kvfleet demo` (`make demo`)


@needs_smollm2
def test_demo_streams_real_answers_then_prints_and_writes_the_sweep(tmp_path: Path):
    script = Path(sys.executable).with_name("kvfleet")  # the installed entry point `make demo` runs
    assert script.exists(), f"no `kvfleet` script beside {sys.executable}"
    out = tmp_path / "demo-sweep.json"
    proc = subprocess.run(
        [str(script), "demo", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    # The cluster's start, part by part, before anything is asked of it.
    assert re.search(r"^   2 workers \(smollm2-135m\) ready \(\d+\.\d s\)$", text.split("== completion", 1)[0], re.M), (
        text
    )
    # Two streamed answers on SmolLM2, each closed by its usage line.
    usage = re.compile(r"\[(\d+) prompt tokens, (\d+) generated, finish: (eos|length)\]")
    completion = text.split(f"== completion: {PROMPT!r}", 1)[1].split("== chat:", 1)[0]
    chat = text.split("== chat: 'Name three primary colors.'", 1)[1].split("== the concurrency sweep", 1)[0]
    for section in (completion, chat):
        found = usage.search(section)
        assert found, section
        assert 1 <= int(found[2]) <= 48  # --max-new-tokens' default
        assert section[: found.start()].strip(), f"nothing streamed before {found[0]}"
    assert "Paris" in completion.split("[", 1)[0], completion
    assert re.search(r"\b(red|blue|yellow)\b", chat.split("[", 1)[0], re.IGNORECASE), chat
    # Then the tiny model's sweep: its table, the reference's ticks, the files at --out only.
    assert _table_ticks(text) == [r["ticks"] for r in _reference_results()] == [64, 33, 19, 15]
    assert "corruption_free: True" in text
    _assert_sweep_files(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-sweep.json", "demo-sweep.png", "demo-sweep.svg"]
    assert f"wrote {out}" in proc.stderr


# ------------------------------------------------ generate / chat on SmolLM2 (the suite's cluster)


NEW_TOKENS = "12"


def _json(address: str, command: str, prompt: str, *flags: str) -> dict:
    run = kvfleet(command, prompt, "--scheduler", address, "--json", *flags)
    assert run.code == 0, run.err
    return json.loads(run.out)


@pytest.fixture(scope="module")
def greedy(smollm2_cluster) -> dict:
    """`generate PROMPT --json` with the default (greedy) sampling: what the flags change."""
    doc = _json(smollm2_cluster.address, "generate", PROMPT, "--max-new-tokens", NEW_TOKENS)
    assert doc["finish_reason"] == "length" and len(doc["token_ids"]) == int(NEW_TOKENS), doc
    return doc


def test_generate_streams_the_text_that_json_reports(smollm2_cluster, greedy):
    run = kvfleet("generate", PROMPT, "--scheduler", smollm2_cluster.address, "--max-new-tokens", NEW_TOKENS)
    assert run.code == 0, run.err
    assert run.out == greedy["text"] and "Paris" in run.out
    assert run.err.strip().splitlines()[-1] == f"[length, {NEW_TOKENS} tokens]"


def test_generate_sampling_flags_reach_the_sampler(smollm2_cluster, greedy):
    def sample(*flags: str) -> list[int]:
        return _json(smollm2_cluster.address, "generate", PROMPT, "--max-new-tokens", NEW_TOKENS, *flags)["token_ids"]

    hot = ("--temperature", "1.0", "--top-k", "40", "--top-p", "0.95")
    first = sample(*hot, "--seed", "7")
    assert sample(*hot, "--seed", "7") == first  # the same seed gives the same output
    assert sample(*hot, "--seed", "8") != first  # another seed, another draw
    assert first != greedy["token_ids"]  # --temperature sampled
    # Top-k 1 or a tiny top-p leave only the likeliest token: greedy again, whatever the seed.
    assert sample("--temperature", "1.0", "--top-k", "1", "--seed", "7") == greedy["token_ids"]
    assert sample("--temperature", "1.0", "--top-p", "0.0001", "--seed", "7") == greedy["token_ids"]


def test_generate_stop_strings_end_the_text(smollm2_cluster, greedy):
    assert "." in greedy["text"], greedy
    # --stop repeats: the first string never occurs, the second ends the session.
    stopped = _json(
        smollm2_cluster.address, "generate", PROMPT, "--max-new-tokens", NEW_TOKENS, "--stop", "zzqx", "--stop", "."
    )
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == greedy["text"].split(".", 1)[0]
    assert len(stopped["token_ids"]) < len(greedy["token_ids"])


def test_chat_ignore_eos_generates_past_the_end(smollm2_cluster):
    # Greedy SmolLM2 answers this in 13 tokens, the last its EOS (the demo's chat).
    question, limit = "Name three primary colors.", 20
    ended = _json(smollm2_cluster.address, "chat", question, "--max-new-tokens", str(limit))
    assert ended["finish_reason"] == "eos" and len(ended["token_ids"]) < limit, ended
    more = _json(smollm2_cluster.address, "chat", question, "--max-new-tokens", str(limit), "--ignore-eos")
    assert more["finish_reason"] == "length" and len(more["token_ids"]) == limit
    assert more["token_ids"][: len(ended["token_ids"])] == ended["token_ids"]


def test_generate_timeout_exits_2_naming_the_deadline(smollm2_cluster):
    # As a process: the exit code and the one line are what a shell sees.
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "kvfleet.cli", "generate", PROMPT),
            *("--scheduler", smollm2_cluster.address, "--max-new-tokens", "256", "--ignore-eos", "--timeout", "0.05"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("kvfleet: DEADLINE_EXCEEDED: no complete answer within --timeout 0.05 s ("), (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# --------------------------------- experiment, summary, telemetry, sweep: one running tiny cluster


@pytest.fixture(scope="module")
def tiny_cluster() -> Iterator[LocalCluster]:
    """Processes with a telemetry service (experiment, summary), one tick at a time and the
    reference's KV budget (the sweep's reference figures)."""
    spec = ClusterSpec(workers=2, model="tiny", overlap_scheduling=False, kv_budget_bytes=REFERENCE_KV_BUDGET_BYTES)
    with LocalCluster(spec) as cluster:
        yield cluster


def test_experiment_writes_json_and_html_and_summary_reads_them_back(tiny_cluster, tmp_path: Path):
    scheduler, telemetry = tiny_cluster.scheduler_address, tiny_cluster.telemetry_address
    refused = kvfleet("experiment", "--scheduler", scheduler, "--out", str(tmp_path / "never.json"))
    assert refused.code == 2 and "also give --telemetry" in refused.err
    assert not (tmp_path / "never.json").exists()

    out = tmp_path / "exp.json"
    workload = ("--repeats", "1", "--sessions", "2", "--prompt-len", "4", "--max-new-tokens", "4", "--concurrency", "2")
    run = kvfleet("experiment", "--scheduler", scheduler, "--telemetry", telemetry, *workload, "--out", str(out))
    assert run.code == 0, run.err
    # The user learns the fresh id from the first line, and reads the summary back by it.
    first = re.fullmatch(r"experiment (persistent_kv_views-[0-9a-f]{32}): status (\w+)", run.out.splitlines()[0])
    assert first, run.out
    experiment_id = first[1]
    doc = json.loads(out.read_text())
    assert doc["experiment_id"] == experiment_id and doc["status"] == first[2]
    assert doc["exactness"]["bitwise_exact"] is True
    assert doc["exactness"]["completion_tokens_per_arm"] == 2 * 4  # sessions x new tokens, one repeat
    assert doc["decision"]["authorize"] is False  # one repeat: too few samples to authorize
    html = out.with_suffix(".html").read_text()
    assert html.startswith("<!DOCTYPE html>") and experiment_id in html
    assert f"wrote {out} and {out.with_suffix('.html')}" in run.err

    back = tmp_path / "summary.json"
    again = kvfleet("summary", experiment_id, "--telemetry", telemetry, "--out", str(back))
    assert again.code == 0, again.err
    assert again.out.splitlines()[0] == run.out.splitlines()[0]
    summary = json.loads(back.read_text())
    for key in ("experiment_id", "status", "exactness", "artifact_sha256", "decision"):
        assert summary[key] == doc[key], key
    assert experiment_id in back.with_suffix(".html").read_text()


def test_telemetry_prints_the_live_snapshot(tiny_cluster):
    scheduler = tiny_cluster.scheduler_address
    before = kvfleet("telemetry", "--scheduler", scheduler)
    assert before.code == 0, before.err
    sent = kvfleet(
        "generate", "1,2,3", "--token-ids", "--max-new-tokens", "5", "--ignore-eos", "--scheduler", scheduler
    )
    assert sent.code == 0, sent.err
    after = kvfleet("telemetry", "--scheduler", scheduler)
    assert after.code == 0, after.err
    old, new = json.loads(before.out), json.loads(after.out)
    assert new["live_workers"] == 2 and new["kv_budget_bytes"] == REFERENCE_KV_BUDGET_BYTES
    assert new["active_sessions"] == 0 and new["queue_depth"] == 0 and new["weight_bytes"] > 0
    # One session of 3 prompt tokens and 5 new ones (the first comes from the prefill).
    assert new["completed_sessions"] - old["completed_sessions"] == 1
    assert new["prefill_tokens_total"] - old["prefill_tokens_total"] == 3
    assert new["decode_tokens_total"] - old["decode_tokens_total"] == 4


def test_sweep_against_a_running_cluster(tiny_cluster, tmp_path: Path):
    out = tmp_path / "sweep.json"
    run = kvfleet("sweep", "--scheduler", tiny_cluster.scheduler_address, "--out", str(out))
    assert run.code == 0, run.err
    assert "starting a local cluster" not in run.err  # it used the one given
    assert _table_ticks(run.out) == [64, 33, 19, 15]
    assert "corruption_free: True" in run.out
    _assert_sweep_files(out)


# ---------------------------------------------------------------- soak (a cluster of its own)


def test_soak_on_the_tiny_model_reports_nothing_lost():
    """`kvfleet soak` (`make soak`) as a user runs it, small: cancels, deadlines, a worker
    SIGKILLed and restarted; nothing lost, every completed session token-exact."""
    run = kvfleet(
        "soak",
        *("--model", "tiny", "--sessions", "40", "--concurrency", "16", "--max-new-tokens", "16"),
        *("--restart-after", "0.5", "--seed", "3"),
    )
    assert run.code == 0, run.out + run.err
    counts = re.search(
        r"^sessions: completed (\d+), cancelled (\d+), expired (\d+), rejected (\d+), lost (\d+)$", run.out, re.M
    )
    assert counts, run.out
    completed, cancelled, *_, lost = map(int, counts.groups())
    assert sum(map(int, counts.groups())) == 40 and lost == 0
    assert completed >= 20 and cancelled > 0  # the soak's cancels happened, and most sessions ran out
    assert f"completed sessions equal to their solo reference: {completed} of {completed}" in run.out
    assert "KV bytes at the end: 0; sessions held by workers: 0" in run.out
    assert "worker killed and restarted midway: worker-1" in run.out
    assert "soak: 40 sessions, 16 concurrent streams, model tiny" in run.err

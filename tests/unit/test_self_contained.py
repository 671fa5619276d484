"""A fresh clone passes `make test`: nothing the tests or the CLI read lies outside the repository."""

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A path built towards ../shared (the reference files beside the checkout, absent in a clone).
OUTSIDE = re.compile(r"""/\s*["']shared["']|["']shared["']\s*/|\.\./shared""")


def test_no_test_or_cli_code_reads_the_shared_folder_beside_the_repository():
    files = [*ROOT.glob("tests/**/*.py"), *ROOT.glob("kvfleet/*.py"), ROOT / "Makefile"]
    offenders = [
        f"{f.relative_to(ROOT)}:{n}"
        for f in files
        if f.resolve() != Path(__file__).resolve()
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert offenders == [], offenders


EXAMPLE = ROOT / "tests" / "data" / "concurrency_sweep_example.json"


def test_the_reference_figures_the_tests_compare_with_are_in_the_repository():
    # The sections the comparing tests read (test_sweep_over_grpc, test_plots), with the shape of
    # the workload they describe: 8 sessions of 8 new tokens, swept at concurrency 1, 2, 4, 8.
    doc = json.loads(EXAMPLE.read_text())
    assert doc["workload"] == {"sessions": 8, "prompt_len": 4, "max_new_tokens": 8}
    sweep = doc["concurrency_sweep"]
    assert [r["concurrency"] for r in sweep["results"]] == [1, 2, 4, 8]
    assert all(r["decode_tokens"] + r["prefill_tokens"] > 0 for r in sweep["results"])
    outputs = sweep["reference_outputs"]
    assert sorted(outputs) == [f"s{i}" for i in range(8)]
    assert all(len(tokens) == 8 and all(0 <= t < doc["model"]["vocab"] for t in tokens) for tokens in outputs.values())
    assert doc["mid_run_telemetry_concurrency_4"]["ticks"] == 6
    # and every test that compares with it reads it from there, not from a copy elsewhere
    readers = sorted(
        f.relative_to(ROOT).as_posix()
        for f in ROOT.glob("tests/**/*.py")
        if f.resolve() != Path(__file__).resolve() and EXAMPLE.name in f.read_text()
    )
    assert readers, "no test compares with the example any more"
    for reader in readers:
        assert '"data" / "concurrency_sweep_example.json"' in (ROOT / reader).read_text(), reader


def test_the_reference_figures_are_committed_so_a_fresh_clone_has_them():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    rel = EXAMPLE.relative_to(ROOT).as_posix()
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", rel], cwd=ROOT, capture_output=True, text=True)
    assert tracked.returncode == 0, f"{rel} is not tracked by git: {tracked.stderr}"


# An import of another test module: its fixtures and helpers run with that module's state.
FROM_TEST_MODULE = re.compile(r"^\s*(from|import)\s+tests\.(\w+\.)*test_\w+")


def test_no_test_imports_from_another_test_module():
    """Shared helpers live in tests/helpers/ (or a non-test module such as tests/unit/sim.py):
    importing a test module runs it a second time and couples two tests' state."""
    offenders = [
        f"{f.relative_to(ROOT)}:{n}"
        for f in ROOT.glob("tests/**/*.py")
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if FROM_TEST_MODULE.match(line)
    ]
    assert offenders == [], offenders

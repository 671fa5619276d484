"""A fresh clone passes `make test`: nothing the tests or the CLI read lies outside the repository."""

import re
from pathlib import Path

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


def test_the_reference_figures_the_tests_compare_with_are_in_the_repository():
    assert (ROOT / "tests" / "data" / "concurrency_sweep_example.json").is_file()

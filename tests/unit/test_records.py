"""`record` (kvfleet_common/records.py): the per-item values of a step, frozen for the type
checker, by value for equality and hashing, and cheap to build."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from kvfleet_common.records import record
from scheduler_svc.core.plan import DecodeWork
from worker_svc.engine import DecodeItem, SamplingSpec


@record
class Point:
    x: int
    label: str = ""


def test_a_record_is_a_dataclass_with_slots_equal_and_hashed_by_value() -> None:
    a, b = Point(1, "a"), Point(1, "a")
    assert a == b and hash(a) == hash(b) and {a, b} == {a}
    assert a != Point(2, "a")
    assert not hasattr(a, "__dict__")  # slots: no per-instance dict
    assert dataclasses.replace(a, x=5) == Point(5, "a") and a.x == 1
    for cls in (DecodeItem, DecodeWork):  # two of the per-item values made with it
        assert dataclasses.is_dataclass(cls) and "__slots__" in vars(cls)
    item = DecodeItem("s", 3, 4, SamplingSpec(), 0)
    assert item == DecodeItem("s", 3, 4, SamplingSpec(), 0)


def test_the_type_checker_refuses_to_assign_a_field(tmp_path: Path) -> None:
    src = tmp_path / "uses_record.py"
    src.write_text(
        "from kvfleet_common.records import record\n"
        "@record\n"
        "class Item:\n"
        "    position: int\n"
        "item = Item(4)\n"
        "item.position = 5\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--ignore-missing-imports",
            "--no-incremental",
            "--follow-imports=silent",
            str(src),
        ],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert 'Property "position" defined in "Item" is read-only' in out.stdout, out.stdout

"""bench.packing's bookkeeping: the arms take turns, a ratio is of medians, and its flags."""

from __future__ import annotations

import pytest

from bench import packing
from scheduler_svc.core import SchedulerLimits


def test_the_arms_alternate_which_goes_first() -> None:
    assert [packing.arm_order(p, 2.0) for p in range(3)] == [[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]


def test_the_ratio_is_of_the_medians() -> None:
    assert packing.ratio_of_medians([600.0, 400.0, 620.0], [450.0, 300.0, 500.0]) == round(600 / 450, 3)
    assert packing.ratio_of_medians([], [1.0]) is None
    assert packing.ratio_of_medians([1.0], [0.0]) is None


def test_sweep_pairs_runs_each_arm_once_a_pair_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []

    def fake_sweep(repeats: int, pack_step_ms: float) -> dict:
        calls.append(pack_step_ms)
        return {"ticks_per_s_median": 600.0 if pack_step_ms else 400.0, "cpu_ms_per_tick": {"total": 1.0}}

    monkeypatch.setattr(packing, "sweep_ticks_per_s", fake_sweep)
    got = packing.sweep_pairs(2, 1, 2.0, progress=lambda m: None)
    assert calls == [2.0, 0.0, 0.0, 2.0]
    assert (got["packed_median"], got["by_load_median"], got["ratio_of_medians"]) == (600.0, 400.0, 1.5)


def test_the_packing_arm_defaults_to_the_scheduler_s_limit_and_must_be_positive(capsys) -> None:
    assert packing.build_parser().parse_args([]).pack_step_ms == SchedulerLimits.pack_step_ms
    with pytest.raises(SystemExit):
        packing.main(["--pack-step-ms", "0", "--pairs", "0", "--smollm2-tokens", "0"])
    assert "--pack-step-ms must be positive" in capsys.readouterr().err

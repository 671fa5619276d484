"""bench.cpu_time: per-process CPU time, per tick, and the tick rate it allows."""

from __future__ import annotations

import os
import time

from bench import cpu_time


def test_process_cpu_time_counts_work_done() -> None:
    before = cpu_time.process_cpu_s(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:  # 0.2 s of this process's own CPU
        pass
    spent = cpu_time.process_cpu_s(os.getpid()) - before
    assert 0.15 <= spent <= 1.0, spent  # clock ticks are 10 ms: allow their rounding
    assert cpu_time.process_cpu_s(2**22 + 7) == 0.0  # no such process: 0, not an exception


def test_per_tick_and_ceiling() -> None:
    got = cpu_time.per_tick_ms({"scheduler": 1.0, "worker-0": 2.0}, {"scheduler": 1.2, "worker-0": 2.5}, 100)
    assert got == {"scheduler": 2.0, "worker-0": 5.0, "total": 7.0}
    assert cpu_time.tick_ceiling(7.0, cores=2) == round(2000 / 7, 1)
    assert cpu_time.tick_ceiling(0.0, cores=2) == float("inf")

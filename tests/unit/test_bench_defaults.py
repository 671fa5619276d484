"""The benchmarks measure what a worker serves unless a run says otherwise: their --kv-views
default is the workers' own (WorkerConfig), and the other mode can still be named."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from bench import modes, prefix_cache, run
from worker_svc.config import WorkerConfig
from worker_svc.kv_views_mode import KVViewsMode


def _parsed(main: Callable[[list[str]], int], argv: list[str]) -> argparse.Namespace:
    """The namespace ``main`` parses from ``argv``, without running the benchmark."""
    got: list[argparse.Namespace] = []
    real = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        got.append(real(self, args, namespace))
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(SystemExit):
            main(argv)
    return got[0]


@pytest.mark.parametrize(
    "main", [run.main, modes.main, prefix_cache.main], ids=["bench", "bench.modes", "prefix_cache"]
)
def test_kv_views_default_is_the_workers(main: Callable[[list[str]], int]) -> None:
    assert _parsed(main, []).kv_views == WorkerConfig.kv_views.value
    other = next(m.value for m in KVViewsMode if m is not WorkerConfig.kv_views)
    assert _parsed(main, ["--kv-views", other]).kv_views == other


def test_control_plane_s_engine_alone_run_holds_long_generations() -> None:
    """bench.control_plane's engine-alone figure for --new-tokens past 60 (its KV pool had four
    blocks a session: OutOfBlocks)."""
    from bench.control_plane import engine_steps_per_s

    assert engine_steps_per_s("tiny", 32, 100, threads=1) > 0  # 32 sessions: past its 64-block floor

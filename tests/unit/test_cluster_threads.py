"""A local cluster's CPU workers share the machine's cores (ClusterSpec.worker_threads): two
workers each with a thread per core oversubscribe them."""

from __future__ import annotations

import os

import pytest

from kvfleet.local_cluster import ClusterSpec, LocalCluster

CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        (ClusterSpec(workers=1), 0),  # one worker: its own default (every core)
        (ClusterSpec(workers=2), max(1, CORES // 2)),
        (ClusterSpec(workers=CORES + 3), 1),  # more workers than cores: one thread each
        (ClusterSpec(workers=2, threads=3), 3),  # as given
        (ClusterSpec(workers=2, device="cuda"), 0),  # not CPU workers: theirs
    ],
)
def test_worker_threads(spec: ClusterSpec, want: int) -> None:
    assert spec.worker_threads == want


def test_negative_threads_are_refused() -> None:
    with pytest.raises(ValueError, match="threads must be >= 0"):
        ClusterSpec(threads=-1)


def test_the_worker_command_carries_its_share(tmp_path, monkeypatch) -> None:
    cluster = LocalCluster(ClusterSpec(workers=2, threads=0), log_dir=tmp_path)
    cluster.worker_addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(cluster, "_spawn", lambda name, args: spawned.__setitem__(name, args))
    cluster._spawn_worker(1)
    args = spawned["worker-1"]
    assert args[args.index("--threads") + 1] == str(max(1, CORES // 2))
    one = LocalCluster(ClusterSpec(workers=1), log_dir=tmp_path)
    one.worker_addresses = ["127.0.0.1:1"]
    monkeypatch.setattr(one, "_spawn", lambda name, args: spawned.__setitem__(name, args))
    one._spawn_worker(0)
    assert "--threads" not in spawned["worker-0"]

"""LocalCluster removes the temporary log folder it made when it stops, keeps it after a failure
(the errors say "logs in <folder>"), and never touches a log folder the caller gave."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from kvfleet.local_cluster import ClusterDown, ClusterSpec, LocalCluster, RestartPolicy, Supervisor


@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory LocalCluster makes its folders in, for this test alone."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def test_a_cluster_that_ran_leaves_nothing_behind(temp_root: Path) -> None:
    with LocalCluster(ClusterSpec(workers=1, model="tiny")) as cluster:
        assert cluster.log_dir.parent == temp_root
        assert {p.name for p in cluster.log_dir.iterdir()} >= {"telemetry.log", "worker-0.log", "scheduler.log"}
    assert list(temp_root.iterdir()) == []
    cluster.stop()  # a second stop is harmless
    assert list(temp_root.iterdir()) == []


def test_a_cluster_never_started_leaves_nothing_behind(temp_root: Path) -> None:
    LocalCluster(ClusterSpec()).stop()
    assert list(temp_root.iterdir()) == []


def test_a_failed_start_keeps_its_logs(temp_root: Path) -> None:
    cluster = LocalCluster(ClusterSpec(workers=1, model="no-such-model", telemetry=False))
    with pytest.raises(RuntimeError, match="worker-0 exited"):
        cluster.start()
    assert cluster.failed and list(temp_root.iterdir()) == [cluster.log_dir]
    assert (cluster.log_dir / "worker-0.log").read_text()


def test_an_error_in_the_with_body_keeps_the_logs_and_ctrl_c_does_not(temp_root: Path) -> None:
    # __exit__ as a `with` block calls it (no processes: nothing was started).
    failed = LocalCluster(ClusterSpec())
    failed.__exit__(ZeroDivisionError, ZeroDivisionError(), None)
    interrupted = LocalCluster(ClusterSpec())
    interrupted.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert list(temp_root.iterdir()) == [failed.log_dir]


class _Dead:
    """A process that has exited."""

    pid = 1
    returncode = 3

    def poll(self) -> int:
        return self.returncode


def test_cluster_down_keeps_the_logs(temp_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = LocalCluster(ClusterSpec())
    now = [100.0]

    def respawn(name: str) -> _Dead:
        cluster.procs[name], cluster.started_at[name] = _Dead(), now[0]
        return cluster.procs[name]

    monkeypatch.setattr(cluster, "respawn", respawn)
    respawn("scheduler")
    supervisor = Supervisor(cluster, {"scheduler": RestartPolicy(max_restarts=1)}, clock=lambda: now[0])
    supervisor.poll()  # the first crash: restarted after its backoff
    now[0] += 1
    supervisor.poll()
    with pytest.raises(ClusterDown, match=str(cluster.log_dir)):
        supervisor.poll()  # the second crash in a row: given up
    cluster.stop()
    assert list(temp_root.iterdir()) == [cluster.log_dir]


def test_a_log_dir_of_the_callers_is_kept(tmp_path: Path) -> None:
    mine = tmp_path / "logs"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with LocalCluster(ClusterSpec(workers=1, model="tiny", telemetry=False), log_dir=mine):
        pass
    assert (mine / "notes.txt").read_text() == "mine" and (mine / "worker-0.log").exists()

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


def test_a_start_refused_for_a_taken_port_leaves_nothing_behind(temp_root: Path) -> None:
    """Nothing ran, so there are no logs to keep: its empty folder goes, and no process starts."""
    import socket

    from kvfleet_common.listen import CannotListen

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        cluster = LocalCluster(ClusterSpec(workers=1, model="tiny", gateway=True, gateway_port=held.getsockname()[1]))
        with pytest.raises(CannotListen, match="--gateway-port$"):
            cluster.start()
    assert cluster.procs == {}
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


def test_the_default_policies_back_off_and_give_up_only_on_the_scheduler(
    temp_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README ("`kvfleet up` supervises"): a restart waits 0.5 s, doubled for each crash in a row
    up to 30 s, and counts from the first again once the process stayed up 30 s; a worker is
    restarted for ever, the scheduler 5 times in a row: its next crash ends the cluster."""
    cluster = LocalCluster(ClusterSpec())
    now = [100.0]
    starts: dict[str, list[float]] = {}

    def respawn(name: str) -> _Dead:
        cluster.procs[name], cluster.started_at[name] = _Dead(), now[0]
        starts.setdefault(name, []).append(now[0])
        return cluster.procs[name]

    monkeypatch.setattr(cluster, "respawn", respawn)
    supervisor = Supervisor(cluster, clock=lambda: now[0])

    def crash_until_restarted(name: str) -> float:
        """Poll in 0.25 s steps from its crash until it is started again; the wait."""
        crashed = now[0]
        before = len(starts[name])
        supervisor.poll()
        while len(starts[name]) == before:
            now[0] += 0.25
            supervisor.poll()
        return now[0] - crashed

    respawn("worker-0")
    waits = [crash_until_restarted("worker-0") for _ in range(8)]
    assert waits == [0.5, 1, 2, 4, 8, 16, 30, 30]
    now[0] += 30  # up 30 s: the next crash is the first in a row again
    assert crash_until_restarted("worker-0") == 0.5

    respawn("scheduler")
    assert [crash_until_restarted("scheduler") for _ in range(5)] == [0.5, 1, 2, 4, 8]
    with pytest.raises(ClusterDown, match="scheduler exited 6 times in a row"):
        supervisor.poll()
    cluster.stop()


def test_a_log_dir_of_the_callers_is_kept(tmp_path: Path) -> None:
    mine = tmp_path / "logs"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with LocalCluster(ClusterSpec(workers=1, model="tiny", telemetry=False), log_dir=mine):
        pass
    assert (mine / "notes.txt").read_text() == "mine" and (mine / "worker-0.log").exists()


def test_an_interrupted_spawn_records_its_process_so_that_stop_stops_it(temp_root: Path) -> None:
    """LocalCluster.interrupt (what a stop signal calls) acts only at safe points: a process being
    started when it comes is recorded before the KeyboardInterrupt, so stop() still stops it, and
    the folder goes (an interrupt is no failure). A supervisor's restart in `kvfleet up` relies on it."""
    cluster = LocalCluster(ClusterSpec())
    cluster.interrupt()
    with pytest.raises(KeyboardInterrupt):
        cluster._spawn("sleeper", ["-c", "import time; time.sleep(60)"])
    proc = cluster.procs["sleeper"]
    assert proc.poll() is None
    cluster.stop(grace_s=5)
    assert proc.poll() is not None
    assert list(temp_root.iterdir()) == []

"""A small soak on the tiny model: cancels, deadlines, a worker SIGKILLed and restarted; nothing lost."""

from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet.soak import SoakSpec, engine_reference, run_soak


def test_small_soak_loses_nothing():
    spec = SoakSpec(sessions=40, concurrency=16, new_tokens=(4, 16), restart_after_s=0.5, seed=3)
    with LocalCluster(ClusterSpec(workers=2, model="tiny", telemetry=False)) as cluster:
        report = run_soak(cluster, spec, engine_reference("tiny"))
    o = report.outcomes
    assert o["lost"] == 0, report.lost_details
    assert o["completed"] + o["cancelled"] + o["expired"] + o["rejected"] == 40
    assert o["completed"] >= 20 and o["cancelled"] > 0
    assert report.mismatched == [], report.mismatch_details
    assert report.kv_bytes_after == 0 and report.worker_sessions_after == 0
    assert report.killed_worker == "worker-1"

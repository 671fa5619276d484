"""The default sweep through real gRPC servers reproduces the reference example's results."""

import json
from pathlib import Path

import pytest

from kvfleet.client import SchedulerClient
from kvfleet.sweep import SweepSpec, format_table, run_sweep
from tests.integration.inproc import InProcessCluster

# Kept inside the repository: a fresh clone must pass `make test` with nothing beside it.
EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "concurrency_sweep_example.json"


def _example() -> dict:
    return json.loads(EXAMPLE.read_text())


@pytest.fixture(scope="module")
def cluster():
    # One tick at a time whatever KVFLEET_TEST_OVERLAP_SCHEDULING says: the reference's tick
    # figures are those (overlapped scheduling gives the same tokens in other ticks).
    with InProcessCluster(workers=2, overlap=False) as c:
        yield c


@pytest.fixture(scope="module")
def sweep_doc(cluster):
    with SchedulerClient(cluster.address) as client:
        return run_sweep(client, SweepSpec())


def test_results_equal_the_example(sweep_doc):
    assert sweep_doc["concurrency_sweep"]["results"] == _example()["concurrency_sweep"]["results"]


def test_outputs_equal_the_numpy_reference(sweep_doc):
    sweep = sweep_doc["concurrency_sweep"]
    assert sweep["corruption_free"] is True
    assert sweep["overlap_scheduling"] is False and "note:" not in format_table(sweep_doc)
    assert len(sweep["reference_outputs"]) == 8
    assert all(len(v) == 8 for v in sweep["reference_outputs"].values())
    assert sweep["saturation_concurrency"] == 8


def test_mid_run_snapshot_has_every_example_field(sweep_doc):
    snap = sweep_doc["mid_run_telemetry_concurrency_4"]
    example = _example()["mid_run_telemetry_concurrency_4"]
    assert set(example) <= set(snap)
    # Hand-worked for tick 6 of the c=4 run with a 4-token budget: s0..s3 admitted in ticks 1..4.
    assert snap["ticks"] == 6
    assert snap["active_sessions"] == 4 and snap["queue_depth"] == 4
    assert snap["prefill_tokens_total"] == 16
    assert snap["decode_tokens_total"] == 1 + 2 + 3 + 4 + 4
    assert snap["kv_total_bytes"] == (9 + 8 + 7 + 6) * 1536
    assert snap["completed_sessions"] == 0
    assert snap["scratch_budget_bytes"] == 4 and snap["scratch_used_bytes"] == 4
    assert snap["kv_pressure"] == round(snap["kv_total_bytes"] / snap["kv_budget_bytes"], 4)
    assert snap["decode_tokens_per_sec"] > 0


def test_other_workload_shapes_follow_the_same_rules(cluster):
    # Prompt 10 > budget 4: chunks of 4, 4, 2; then 3 decodes. One session alone: 3 + 3 ticks.
    spec = SweepSpec(sessions=1, prompt_len=10, max_new_tokens=4, prefill_budget=4, concurrency=(1,))
    with SchedulerClient(cluster.address) as client:
        row = run_sweep(client, spec)["concurrency_sweep"]["results"][0]
    assert row["ticks"] == 6
    assert row["prefill_tokens"] == 10 and row["decode_tokens"] == 3
    assert row["peak_kv_bytes"] == (10 + 2) * 1536


def test_a_sweep_of_a_scheduler_that_overlaps_its_ticks_says_so():
    """Against a running scheduler with --overlap-scheduling (`kvfleet up`'s default) the tokens
    are the reference's and the tick counts are not: the document and the table say why."""
    with InProcessCluster(workers=1, overlap=True) as c, SchedulerClient(c.address) as client:
        doc = run_sweep(client, SweepSpec(concurrency=(2, 8)))
    sweep = doc["concurrency_sweep"]
    assert sweep["overlap_scheduling"] is True and sweep["corruption_free"] is True
    example = {r["concurrency"]: r for r in _example()["concurrency_sweep"]["results"]}
    assert [r["ticks"] for r in sweep["results"]] != [example[c]["ticks"] for c in (2, 8)]  # why it says so
    assert format_table(doc).splitlines()[-1].startswith("note: this scheduler overlaps its ticks")

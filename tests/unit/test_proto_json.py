"""kvfleet.proto_json.message_dict: what `kvfleet workers` and `kvfleet telemetry` print, 64-bit
integers as JSON numbers at any depth, every other value as protobuf's JSON writes it."""

from __future__ import annotations

import json

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.metrics.v1.metrics_pb2 import HistogramDataPoint

from kvfleet.proto_json import message_dict
from kvfleet.v1 import scheduler_pb2 as spb


def test_top_level_and_nested_64_bit_integers_are_numbers_and_the_rest_is_unchanged() -> None:
    w = spb.WorkerState(worker_id="worker-0", live=True, model="tiny", kv_capacity_tokens=65536, rss_bytes=2**40 + 1)
    got = message_dict(spb.ListWorkersResponse(workers=[w]))
    (row,) = got["workers"]
    assert row["kv_capacity_tokens"] == 65536 and row["rss_bytes"] == 2**40 + 1  # int64 / uint64
    assert row["weight_bytes"] == 0  # a default, printed too, as a number
    assert (row["worker_id"], row["live"], row["model"]) == ("worker-0", True, "tiny")
    # protobuf's own JSON: the same keys, the 64-bit values as strings.
    plain = MessageToDict(w, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    assert plain["rss_bytes"] == str(2**40 + 1) and set(plain) == set(row)
    assert json.loads(json.dumps(got)) == got


def test_map_values_repeated_fields_and_messages_inside_repeated_messages() -> None:
    snap = spb.TelemetrySnapshot(ticks=6, rejected_by_reason={"kv_budget": 3, "queue_full": 1})
    got = message_dict(snap)
    assert got["ticks"] == 6 and got["rejected_by_reason"] == {"kv_budget": 3, "queue_full": 1}
    event = spb.WorkloadEvent(
        stats=spb.WorkloadStats(ticks=9), batch=[spb.WorkloadEvent(stats=spb.WorkloadStats(ticks=4))]
    )
    got = message_dict(event)
    assert got["stats"]["ticks"] == 9 and got["batch"][0]["stats"]["ticks"] == 4
    # A repeated 64-bit field (fixed64 here): each element a number.
    point = message_dict(HistogramDataPoint(bucket_counts=[1, 2**53], start_time_unix_nano=7, sum=1.5))
    assert point["bucket_counts"] == [1, 2**53] and point["start_time_unix_nano"] == 7 and point["sum"] == 1.5

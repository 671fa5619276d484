"""RecordArtifact's size limit on the real telemetry server: an oversized request is refused
RESOURCE_EXHAUSTED with the limit named, nothing is stored, and the service keeps taking
artifacts of ordinary size."""

from __future__ import annotations

import json

import grpc
import pytest

from kvfleet.v1 import telemetry_pb2 as tpb
from kvfleet.v1 import telemetry_pb2_grpc as tpb_grpc
from telemetry_svc.server import DEFAULT_MAX_ARTIFACT_BYTES, TelemetryConfig
from tests.helpers.telemetry_server import RunningServer

LIMIT = 64 * 1024


@pytest.fixture
def server(tmp_path):
    srv = RunningServer(TelemetryConfig(port=0, db_path=str(tmp_path / "t.db"), max_artifact_bytes=LIMIT))
    yield srv
    srv.stop()


def _tokens(n: int) -> str:
    return json.dumps([[i % 50_000 for i in range(n)]], separators=(",", ":"))


def test_an_oversized_artifact_is_refused_and_nothing_is_stored(server):
    stub = tpb_grpc.TelemetryStub(server.channel)
    big = tpb.ArtifactRequest(
        experiment_id="e1", arm="control", kind=tpb.ARTIFACT_KIND_TOKENS, tokens_json=_tokens(20_000)
    )
    assert big.ByteSize() > LIMIT
    with pytest.raises(grpc.RpcError) as info:
        stub.RecordArtifact(big, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"at most {LIMIT}" in info.value.details() and "--max-artifact-kb" in info.value.details()
    big_value = tpb.ArtifactRequest(experiment_id="e1", kind=tpb.ARTIFACT_KIND_TREATMENT, value="v" * (LIMIT + 1))
    with pytest.raises(grpc.RpcError) as info:
        stub.RecordArtifact(big_value, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not stub.ListExperiments(tpb.ListExperimentsRequest(), timeout=10).experiments
    # Ordinary artifacts still go in.
    small = tpb.ArtifactRequest(
        experiment_id="e1", arm="control", kind=tpb.ARTIFACT_KIND_TOKENS, tokens_json=_tokens(100)
    )
    assert len(stub.RecordArtifact(small, timeout=10).sha256) == 64
    [exp] = stub.ListExperiments(tpb.ListExperimentsRequest(), timeout=10).experiments
    assert list(exp.artifact_kinds) == ["tokens/control"]


def test_the_default_limit_takes_a_large_experiment():
    # 64 sessions x 2048 tokens x 6 repeats of token ids, as kvfleet experiment sends them.
    doc = json.dumps([[40_000 + i % 9_000 for i in range(2048)] for _ in range(64 * 6)], separators=(",", ":"))
    assert len(doc) < DEFAULT_MAX_ARTIFACT_BYTES


@pytest.mark.parametrize("bad", [0, 1023, 64 * 1024 * 1024])
def test_a_nonsensical_limit_is_refused(bad):
    with pytest.raises(ValueError, match="max_artifact_bytes"):
        TelemetryConfig(max_artifact_bytes=bad)

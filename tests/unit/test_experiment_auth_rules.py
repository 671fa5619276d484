"""Who may tag a workload with an experiment (ExperimentWriters), and experiment ids that
nobody can guess."""

from __future__ import annotations

import re

import pytest

from kvfleet import experiment
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.experiments import EXPERIMENT_TOKEN_HEADER, ExperimentWriters

TOKEN = "t" * 32
H = EXPERIMENT_TOKEN_HEADER


@pytest.mark.parametrize(
    "writers, metadata, peers, allowed",
    [
        (ExperimentWriters(), (), set(), True),  # loopback, nothing configured: one host
        (ExperimentWriters(loopback_only=False), (), set(), False),  # beyond loopback, nothing configured
        (ExperimentWriters(loopback_only=False), ((H, TOKEN),), set(), False),  # a token nobody set
        (ExperimentWriters(TOKEN), (), set(), False),
        (ExperimentWriters(TOKEN), ((H, TOKEN),), set(), True),
        (ExperimentWriters(TOKEN), ((H, TOKEN[:-1] + "u"),), set(), False),
        (ExperimentWriters(TOKEN), ((H, TOKEN), (H, TOKEN)), set(), False),  # repeated: refused
        (ExperimentWriters(TOKEN), (("authorization", f"Bearer {TOKEN}"),), set(), False),  # not the API token
        (ExperimentWriters(names=frozenset({"lab"})), (), {"lab"}, True),
        (ExperimentWriters(names=frozenset({"lab"})), (), {"intruder"}, False),
        (ExperimentWriters(TOKEN, frozenset({"lab"}), loopback_only=False), (), {"lab"}, True),
    ],
)
def test_who_may_tag_an_experiment(writers, metadata, peers, allowed):
    refusal = writers.refusal(metadata, peers)
    assert (refusal is None) == allowed, refusal
    if refusal is not None:
        assert "experiment" in refusal and ("KVFLEET_EXPERIMENT" in refusal or H in refusal or "once" in refusal)


def test_a_short_experiment_token_is_refused_at_start_up():
    with pytest.raises(ValueError, match="KVFLEET_EXPERIMENT_TOKEN must be at least 16"):
        SchedulerConfig(workers=("127.0.0.1:1",), experiment_token="short")


def test_the_config_knows_where_it_listens():
    assert SchedulerConfig(workers=("w:1",)).experiments.loopback_only
    beyond = SchedulerConfig(workers=("w:1",), host="0.0.0.0", api_token="x" * 20)
    assert not beyond.experiments.loopback_only


def test_the_client_sends_the_header_the_scheduler_reads():
    assert experiment.EXPERIMENT_TOKEN_HEADER == EXPERIMENT_TOKEN_HEADER


def test_experiment_ids_carry_128_random_bits():
    ids = {experiment.new_experiment_id("persistent_kv_views") for _ in range(1000)}
    assert len(ids) == 1000
    for i in ids:
        assert re.fullmatch(r"persistent_kv_views-[0-9a-f]{32}", i), i

"""--max-model-len (issue 21 point 5): the worker flag and its environment variable, its bound
by the model's own context (a start-up error naming both), what the engine then serves and
reports as its max_position, and `kvfleet up` passing it to the workers."""

from __future__ import annotations

import dataclasses

import pytest

import worker_svc.__main__ as worker_main
from kvfleet.cli import _spec, build_parser
from kvfleet.local_cluster import ClusterSpec
from kvfleet_models.config import tiny_config
from tests.helpers.environment import clear_kvfleet_env, no_service_logging
from worker_svc.config import WorkerConfig
from worker_svc.engine import served_length


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_kvfleet_env(monkeypatch)
    no_service_logging(monkeypatch)


def test_worker_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert worker_main.parse_args([]).max_model_len == 0 == WorkerConfig().max_model_len
    assert worker_main.parse_args(["--max-model-len", "256"]).max_model_len == 256
    monkeypatch.setenv("KVFLEET_MAX_MODEL_LEN", "128")
    assert worker_main.parse_args([]).max_model_len == 128
    assert worker_main.parse_args(["--max-model-len", "64"]).max_model_len == 64  # the flag wins
    with pytest.raises(ValueError, match="max-model-len must be >= 0"):
        WorkerConfig(max_model_len=-1)


def test_served_length_is_bounded_by_the_models_own() -> None:
    cfg = tiny_config()  # max_position 512
    assert served_length(0, cfg) == 512
    assert served_length(100, cfg) == 100
    assert served_length(512, cfg) == 512
    with pytest.raises(ValueError) as err:
        served_length(513, cfg)
    assert "--max-model-len 513" in str(err.value) and "512" in str(err.value) and "'tiny'" in str(err.value)


def test_engine_serves_and_reports_the_reduced_length() -> None:
    from kvfleet_models.registry import load_model
    from worker_svc import convert
    from worker_svc.server import build_engine

    model = load_model("tiny")
    config = WorkerConfig(num_blocks=8, max_model_len=40)
    cfg, engine = build_engine(config, model)
    assert engine.max_model_len == 40 and cfg.max_position == 512  # the model's RoPE is untouched
    info = convert.info_to_pb("w", cfg, engine, config.block_size, config.num_blocks, "i")
    assert (info.model.max_position, info.model.model_max_position) == (40, 512)
    with pytest.raises(ValueError, match="exceeds model 'tiny'.s own context of 512"):
        build_engine(dataclasses.replace(config, max_model_len=600), model)


def test_worker_start_up_error_names_both(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        worker_main.main(["--model", "tiny", "--max-model-len", "4096", "--num-blocks", "8"])
    assert "--max-model-len 4096" in str(stop.value.code) and "512" in str(stop.value.code)


def test_kvfleet_up_passes_it_to_the_workers() -> None:
    a = build_parser().parse_args(["up", "--max-model-len", "64"])
    spec = _spec(a, a.port)
    assert spec.max_model_len == 64
    assert _spec(build_parser().parse_args(["up"]), 0).max_model_len == 0 == ClusterSpec().max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        ClusterSpec(max_model_len=-1)


def test_local_cluster_gives_each_worker_the_flag(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvfleet.local_cluster import LocalCluster

    commands: dict[str, list[str]] = {}
    for spec, want in ((ClusterSpec(max_model_len=64), ["--max-model-len", "64"]), (ClusterSpec(), [])):
        cluster = LocalCluster(spec, log_dir=tmp_path)
        cluster.worker_addresses = ["127.0.0.1:1"]
        monkeypatch.setattr(cluster, "_spawn", lambda name, args: commands.__setitem__(name, args))
        cluster._spawn_worker(0)
        args = commands["worker-0"]
        got = args[args.index("--max-model-len") :][:2] if "--max-model-len" in args else []
        assert got == want

"""Secure defaults, no network: the worker secret (from the environment or a file, checked in
constant time, a repeated header refused), and the refusals to listen beyond loopback unguarded
(worker without secret or mutual TLS, scheduler and gateway without a token)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway_svc.config import GatewayConfig
from kvfleet_common.security import (
    WORKER_SECRET_HEADER,
    DuplicateMetadata,
    TlsConfig,
    is_loopback,
    single_metadata,
    token_refusal,
    worker_secret_from_env,
    worker_secret_refusal,
)
from scheduler_svc.config import SchedulerConfig
from worker_svc.config import WorkerConfig

SECRET = "x" * 32


@pytest.mark.parametrize(
    "host,loopback",
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("", False),
        ("::", False),
        ("10.0.0.7", False),
        ("worker-0", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_single_metadata_refuses_a_repeated_key() -> None:
    assert single_metadata([("a", "1"), ("b", b"2")], "b") == "2"
    assert single_metadata([("a", "1")], "b") is None and single_metadata(None, "b") is None
    with pytest.raises(DuplicateMetadata, match="2 times"):
        single_metadata([("b", "1"), ("b", "2")], "b")


def test_token_refusal_says_why_and_refuses_two_authorization_entries() -> None:
    good = ("authorization", "Bearer t0ken")
    assert token_refusal([good], "t0ken") is None
    assert "no bearer token" in token_refusal([], "t0ken")
    assert "wrong" in token_refusal([("authorization", "Bearer nope")], "t0ken")
    # one right and one wrong: which one a proxy saw is unknowable, so neither counts
    assert "more than one" in token_refusal([good, ("authorization", "Bearer x")], "t0ken")
    assert "more than one" in token_refusal([good, good], "")  # even with no token configured
    assert token_refusal([], "") is None


def test_worker_secret_refusal_names_the_fix_and_nothing_of_the_worker() -> None:
    assert worker_secret_refusal([(WORKER_SECRET_HEADER, SECRET)], SECRET) is None
    assert worker_secret_refusal([], "") is None  # no secret configured: not checked
    for metadata, why in (
        ([], "obeys only its scheduler"),
        ([(WORKER_SECRET_HEADER, SECRET[:-1] + "y")], "wrong worker secret"),
        ([(WORKER_SECRET_HEADER, SECRET), (WORKER_SECRET_HEADER, SECRET)], "more than once"),
    ):
        refusal = worker_secret_refusal(metadata, SECRET)
        assert refusal is not None and why in refusal and WORKER_SECRET_HEADER in refusal
        assert SECRET not in refusal


def test_worker_secret_from_env_or_file(tmp_path: Path) -> None:
    assert worker_secret_from_env({}) == ""
    assert worker_secret_from_env({"KVFLEET_WORKER_SECRET": SECRET}) == SECRET
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")  # files end in a newline; it is not part of the secret
    assert worker_secret_from_env({"KVFLEET_WORKER_SECRET_FILE": str(f)}) == SECRET
    with pytest.raises(ValueError, match="not both"):
        worker_secret_from_env({"KVFLEET_WORKER_SECRET": SECRET, "KVFLEET_WORKER_SECRET_FILE": str(f)})
    with pytest.raises(ValueError, match="at least 16 characters"):
        worker_secret_from_env({"KVFLEET_WORKER_SECRET": "short"})
    with pytest.raises(ValueError, match="cannot read"):
        worker_secret_from_env({"KVFLEET_WORKER_SECRET_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        worker_secret_from_env({"KVFLEET_WORKER_SECRET_FILE": str(tmp_path / "empty")})


def test_telemetry_token_from_env_or_file_and_the_exporter_header(tmp_path: Path) -> None:
    from kvfleet_common.security import telemetry_token_from_env
    from kvfleet_common.tracing import telemetry_headers

    path = tmp_path / "token"
    path.write_text("  tok-from-file\n")
    assert telemetry_token_from_env({"KVFLEET_TELEMETRY_TOKEN": "tok"}) == "tok"
    assert telemetry_token_from_env({"KVFLEET_TELEMETRY_TOKEN_FILE": str(path)}) == "tok-from-file"
    assert telemetry_token_from_env({}) == ""
    with pytest.raises(ValueError, match="not both"):
        telemetry_token_from_env({"KVFLEET_TELEMETRY_TOKEN": "a", "KVFLEET_TELEMETRY_TOKEN_FILE": str(path)})
    with pytest.raises(ValueError, match="cannot read"):
        telemetry_token_from_env({"KVFLEET_TELEMETRY_TOKEN_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        telemetry_token_from_env({"KVFLEET_TELEMETRY_TOKEN_FILE": str(tmp_path / "empty")})
    assert telemetry_headers({"KVFLEET_TELEMETRY_TOKEN_FILE": str(path)}) == {"authorization": "Bearer tok-from-file"}
    assert telemetry_headers({}) is None
    # The standard variable wins: the exporter reads it itself.
    assert (
        telemetry_headers({"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer x", "KVFLEET_TELEMETRY_TOKEN": "y"})
        is None
    )


def test_the_telemetry_service_takes_its_token_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from telemetry_svc.__main__ import parse_args

    monkeypatch.delenv("KVFLEET_TELEMETRY_TOKEN", raising=False)
    path = tmp_path / "token"
    path.write_text("tok-from-file\n")
    monkeypatch.setenv("KVFLEET_TELEMETRY_TOKEN_FILE", str(path))
    config, _ = parse_args(["--db", str(tmp_path / "t.db")])
    assert config.auth.token == "tok-from-file"


def test_secrets_stay_out_of_config_reprs() -> None:
    assert SECRET not in repr(WorkerConfig(worker_secret=SECRET))
    assert SECRET not in repr(SchedulerConfig(workers=("w:1",), worker_secret=SECRET))


def test_worker_beyond_loopback_needs_the_secret_or_mutual_tls(tmp_path: Path) -> None:
    WorkerConfig(host="127.0.0.1")  # loopback: only this machine reaches it
    with pytest.raises(ValueError, match="beyond loopback.*KVFLEET_WORKER_SECRET"):
        WorkerConfig(host="0.0.0.0")
    WorkerConfig(host="0.0.0.0", worker_secret=SECRET)
    for p in ("c.pem", "k.pem", "ca.pem"):
        (tmp_path / p).write_text("x")
    tls = dict(cert=str(tmp_path / "c.pem"), key=str(tmp_path / "k.pem"), ca=str(tmp_path / "ca.pem"))
    WorkerConfig(host="0.0.0.0", tls=TlsConfig(**tls, client_auth=True))
    with pytest.raises(ValueError, match="beyond loopback"):  # TLS without client certificates
        WorkerConfig(host="0.0.0.0", tls=TlsConfig(**tls, client_auth=False))


def test_scheduler_beyond_loopback_needs_a_token_unless_told_anonymous() -> None:
    SchedulerConfig(host="127.0.0.1", workers=("w:1",))
    with pytest.raises(ValueError, match="beyond loopback.*KVFLEET_TLS_CLIENT_AUTH=true.*--allow-anonymous"):
        SchedulerConfig(host="0.0.0.0", workers=("w:1",))
    SchedulerConfig(host="0.0.0.0", workers=("w:1",), api_token="t" * 20)
    SchedulerConfig(host="0.0.0.0", workers=("w:1",), allow_anonymous=True)


def test_open_gateway_beyond_loopback_needs_allow_anonymous() -> None:
    GatewayConfig(host="127.0.0.1")
    with pytest.raises(ValueError, match="beyond loopback.*--allow-anonymous"):
        GatewayConfig(host="0.0.0.0")
    GatewayConfig(host="0.0.0.0", allow_anonymous=True)
    GatewayConfig(host="0.0.0.0", api_key="k" * 20)
    GatewayConfig(host="0.0.0.0", pass_through_key=True)

"""deploy/tls/make_dev_certs.sh: one folder per service holding only that service's key, the CA's
key in none of them, and server certificates that name their own service and nothing else."""

from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path

import pytest

from tests.helpers.certs import make_dev_certs, run_dev_certs_script

IDENTITIES = ("scheduler", "worker", "telemetry", "gateway", "client")
LOOPBACK = {"DNS:localhost", "IP:127.0.0.1"}
# What each server is dialled as: compose service names, Kubernetes Service / pod names.
OWN_NAMES = {
    "scheduler": {"DNS:scheduler", "DNS:kvfleet-scheduler"},
    "worker": {
        "DNS:worker",
        "DNS:worker-0",
        "DNS:worker-1",
        "DNS:kvfleet-worker-0.kvfleet-worker",
        "DNS:kvfleet-worker-1.kvfleet-worker",
    },
    "telemetry": {"DNS:telemetry", "DNS:kvfleet-telemetry"},
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    # KVFLEET_KEY_MODE=644 as the compose instructions once said: it must not reach the CA's key.
    return make_dev_certs(out, "worker=hostA", "worker=10.0.0.7", "scheduler=control", KVFLEET_KEY_MODE="644")


def _sans(cert: Path) -> set[str]:
    out = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    names = (n.strip() for line in out.splitlines()[1:] for n in line.split(","))
    return {re.sub(r"^IP Address:", "IP:", n) for n in names if n}


def _subject_cn(cert: Path) -> str:
    out = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-subject", "-nameopt", "multiline"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return re.search(r"commonName\s*=\s*(\S+)", out).group(1)


def test_each_service_folder_holds_its_own_key_and_the_ca_certificate_only(certs: Path) -> None:
    for ident in IDENTITIES:
        folder = certs / ident
        assert sorted(p.name for p in folder.iterdir()) == sorted(["ca.pem", f"{ident}.pem", f"{ident}.key"]), ident
        assert all(not p.is_symlink() for p in folder.iterdir()), ident  # a mounted link would dangle
        assert (folder / "ca.pem").read_bytes() == (certs / "ca.pem").read_bytes()
        assert _subject_cn(folder / f"{ident}.pem") == f"kvfleet-{ident}"
    keys = sorted(p.relative_to(certs).as_posix() for p in certs.rglob("*.key") if not p.is_symlink())
    assert keys == sorted(["ca.key", *(f"{i}/{i}.key" for i in IDENTITIES)])
    # the flat names still work for processes on this host (kvfleet up, the integration tests)
    assert (certs / "scheduler.key").resolve() == (certs / "scheduler" / "scheduler.key").resolve()


def test_the_ca_key_is_private_whatever_mode_the_service_keys_get(certs: Path) -> None:
    assert stat.S_IMODE((certs / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((certs / "worker" / "worker.key").stat().st_mode) == 0o644  # as asked


@pytest.mark.parametrize("ident", sorted(OWN_NAMES))
def test_a_server_certificate_names_its_own_service_only(certs: Path, ident: str) -> None:
    extra = {"worker": {"DNS:hostA", "IP:10.0.0.7"}, "scheduler": {"DNS:control"}}.get(ident, set())
    assert _sans(certs / ident / f"{ident}.pem") == LOOPBACK | OWN_NAMES[ident] | extra


@pytest.mark.parametrize("ident", ["gateway", "client"])
def test_client_certificates_name_no_server(certs: Path, ident: str) -> None:
    out = subprocess.run(
        [
            "openssl",
            "x509",
            "-in",
            str(certs / ident / f"{ident}.pem"),
            "-noout",
            "-ext",
            "subjectAltName,extendedKeyUsage",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Alternative Name" not in out and "TLS Web Client Authentication" in out
    assert "Server Authentication" not in out


def test_an_extra_name_must_say_whose_certificate_it_goes_on(tmp_path: Path) -> None:
    for bad in ("hostA", "gateway=hostA", "worker="):
        made = run_dev_certs_script(tmp_path / bad.replace("=", "_"), bad)
        assert made.returncode != 0 and "names no server certificate" in made.stderr, (bad, made.stderr)

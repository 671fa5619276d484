"""TLS, mutual TLS and the bearer token, configured per process from the environment.

KVFLEET_TLS_CERT, KVFLEET_TLS_KEY  this process's certificate and key (PEM): its server
                                   identity, and its client identity towards other services
KVFLEET_TLS_CA                     the CA that signs the peers; set alone, a client trusts it
KVFLEET_TLS_CLIENT_AUTH=true       a server requires client certificates (mutual TLS)
KVFLEET_TLS_ALLOWED_CLIENTS        common names a server gated by authorize_peer (a worker) admits;
                                   unset under TLS: only kvfleet-scheduler; `*`: any certificate
                                   the CA signed
KVFLEET_API_TOKEN                  the scheduler's client API wants "authorization: Bearer <token>";
                                   clients send it when set
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

SCHEDULER_CLIENT = "kvfleet-scheduler"  # the common name of the scheduler's certificate
ANY_CLIENT = "*"  # KVFLEET_TLS_ALLOWED_CLIENTS: any certificate of the CA


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the TLS {what} {path}: {exc.strerror}") from exc


@dataclass(frozen=True)
class TlsConfig:
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    client_auth: bool = False
    # None: not configured, so authorize_peer's default applies (under TLS, the scheduler only)
    allowed_clients: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("TLS needs both a certificate and its key (KVFLEET_TLS_CERT and KVFLEET_TLS_KEY)")
        if self.client_auth and not self.ca:
            raise ValueError("mutual TLS (KVFLEET_TLS_CLIENT_AUTH) needs KVFLEET_TLS_CA to check clients")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "TlsConfig":
        env = os.environ if env is None else env
        allowed = frozenset(c.strip() for c in env.get("KVFLEET_TLS_ALLOWED_CLIENTS", "").split(",") if c.strip())
        return cls(
            cert=env.get("KVFLEET_TLS_CERT") or None,
            key=env.get("KVFLEET_TLS_KEY") or None,
            ca=env.get("KVFLEET_TLS_CA") or None,
            client_auth=env.get("KVFLEET_TLS_CLIENT_AUTH", "").lower() in ("1", "true", "yes"),
            allowed_clients=allowed or None,
        )

    @property
    def serves_tls(self) -> bool:
        return bool(self.cert)

    @property
    def dials_tls(self) -> bool:
        return bool(self.ca or self.cert)

    def admitted_clients(self, default: frozenset[str]) -> frozenset[str] | None:
        """The client common names a gated server admits; None = anyone who reaches it.

        A plaintext server cannot tell clients apart, so it admits anyone unless names were
        configured (then nobody: no certificate, no name). Under TLS the default closes the door:
        a worker must not obey whoever holds some certificate of the CA."""
        if self.allowed_clients is None:
            return default if self.serves_tls else None
        return None if ANY_CLIENT in self.allowed_clients else self.allowed_clients

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key, "key"), _read(self.cert, "certificate"))],
            root_certificates=_read(self.ca, "CA"),
            require_client_auth=self.client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA"),
            private_key=_read(self.key, "key"),
            certificate_chain=_read(self.cert, "certificate"),
        )


def channel(address: str, tls: TlsConfig | None = None, options=None) -> grpc.Channel:
    tls = TlsConfig.from_env() if tls is None else tls
    if tls.dials_tls:
        return grpc.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.insecure_channel(address, options=options)


def aio_channel(address: str, tls: TlsConfig | None = None, options=None) -> grpc.aio.Channel:
    tls = TlsConfig.from_env() if tls is None else tls
    if tls.dials_tls:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


def token_metadata(token: str | None = None) -> list[tuple[str, str]]:
    token = os.environ.get("KVFLEET_API_TOKEN", "") if token is None else token
    return [("authorization", f"Bearer {token}")] if token else []


def peer_common_names(context) -> set[str]:
    return {v.decode() for v in context.auth_context().get("x509_common_name", [])}


async def authorize_peer(context, tls: TlsConfig, default: frozenset[str] = frozenset({SCHEDULER_CLIENT})) -> None:
    """Refuse a client whose certificate's common name is not admitted (TlsConfig.admitted_clients)."""
    allowed = tls.admitted_clients(default)
    if allowed is None:
        return
    names = peer_common_names(context)
    if names & allowed:
        return
    hint = (
        ""
        if tls.client_auth
        else (" (this server does not ask for client certificates: set KVFLEET_TLS_CLIENT_AUTH=true)")
    )
    await context.abort(
        grpc.StatusCode.PERMISSION_DENIED,
        f"client certificate {sorted(names) or 'none'} is not allowed here; allowed: "
        f"{sorted(allowed)}{hint}; KVFLEET_TLS_ALLOWED_CLIENTS changes that",
    )


async def authorize_token(context, token: str) -> None:
    if not token:
        return
    sent = dict(context.invocation_metadata() or ()).get("authorization", "")
    if sent != f"Bearer {token}":
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong bearer token; send metadata 'authorization: Bearer <token>'"
            if sent
            else "no bearer token; send metadata 'authorization: Bearer <token>'",
        )

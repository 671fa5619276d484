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
KVFLEET_WORKER_SECRET              the scheduler<->worker shared secret: a worker obeys only calls
                                   carrying it (metadata x-kvfleet-worker-secret), the scheduler
                                   sends it on every worker call; the same value for both, at
                                   least 16 characters (`kvfleet up` makes a fresh one per run)
KVFLEET_WORKER_SECRET_FILE         the same, read from a file (a mounted Kubernetes or Docker
                                   Secret); one of the two, not both

A worker listening beyond loopback must have mutual TLS or the secret: plaintext cannot tell its
scheduler from anyone else who reaches the port (who could list, free or probe other users'
sessions). Every secret and token is compared in constant time, and a call carrying one of these
metadata entries twice is refused: two values leave it open which one a check saw.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import ipaddress
import os
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvfleet_common.flags import parse_switch

SCHEDULER_CLIENT = "kvfleet-scheduler"  # the common name of the scheduler's certificate
ANY_CLIENT = "*"  # KVFLEET_TLS_ALLOWED_CLIENTS: any certificate of the CA
WORKER_SECRET_HEADER = "x-kvfleet-worker-secret"  # gRPC metadata keys are lower case
MIN_SECRET_CHARS = 16
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` keeps a port on this machine ("" and 0.0.0.0 do not)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the TLS {what} {path} ({_VARIABLES[what]}): {exc.strerror}") from exc


_VARIABLES = {"certificate": "KVFLEET_TLS_CERT", "key": "KVFLEET_TLS_KEY", "CA": "KVFLEET_TLS_CA"}


def _switch(env: Mapping[str, str], name: str) -> bool:
    """A true/false variable (flags.parse_switch: a typo must not turn a check off)."""
    try:
        return parse_switch(env.get(name, ""))
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


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
            client_auth=_switch(env, "KVFLEET_TLS_CLIENT_AUTH"),
            allowed_clients=allowed or None,
        )

    def checked(self) -> "TlsConfig":
        """Itself, once the files it names are read and are what they should be: a PEM
        certificate and its private key, a PEM CA bundle. A ValueError naming the variable
        otherwise; a service checks at start-up, where grpc would only fail to bind its port."""
        for path, what in ((self.cert, "certificate"), (self.key, "key"), (self.ca, "CA")):
            _read(path, what)
        try:
            if self.cert and self.key:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert, self.key)
        except ssl.SSLError as exc:
            raise ValueError(
                f"the TLS certificate {self.cert} (KVFLEET_TLS_CERT) and key {self.key} (KVFLEET_TLS_KEY) are not a "
                f"PEM certificate and its private key: {exc.reason or exc}"
            ) from None
        try:
            if self.ca:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=self.ca)
        except ssl.SSLError as exc:
            raise ValueError(
                f"the TLS CA {self.ca} (KVFLEET_TLS_CA) holds no PEM certificate: {exc.reason or exc}"
            ) from None
        return self

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


class DuplicateMetadata(ValueError):
    """A credential's metadata key came more than once."""


def single_metadata(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    """The one value of ``key`` in gRPC metadata (None: absent); DuplicateMetadata if repeated,
    since checks that read the first or the last of two could then disagree."""
    found = [v for k, v in (metadata or ()) if k == key]
    if len(found) > 1:
        raise DuplicateMetadata(f"metadata {key!r} sent {len(found)} times; send it exactly once")
    if not found:
        return None
    value = found[0]
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def same_secret(sent: str, expected: str) -> bool:
    """Constant-time equality: how long a compare takes must not tell how much of a guess was right."""
    return hmac.compare_digest(sent.encode(), expected.encode())


def token_refusal(metadata: Iterable[tuple[str, str | bytes]] | None, token: str) -> str | None:
    """Why the call's bearer token does not pass (None: it does, or no token is configured).
    A repeated authorization entry is refused even when no token is wanted."""
    try:
        sent = single_metadata(metadata, "authorization")
    except DuplicateMetadata:
        return "more than one 'authorization' metadata entry; send exactly one 'authorization: Bearer <token>'"
    if not token:
        return None
    if sent is None:
        return "no bearer token; send metadata 'authorization: Bearer <token>'"
    if not same_secret(sent, f"Bearer {token}"):
        return "missing or wrong bearer token; send metadata 'authorization: Bearer <token>'"
    return None


def caller_identity(context) -> str:
    """Who is calling, as far as the transport tells: the bearer token (hashed) and the client
    certificate's name, each where there is one, else "" (anonymous). Both count: callers that
    share one API token are still told apart by their certificates under mutual TLS, and a
    caller's own token cannot make it another certificate's holder. A session may be cancelled
    only by the same caller; the prefix cache and the queue's shares are per caller."""
    parts = []
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and value:
            parts.append("token:" + hashlib.sha256(value.encode()).hexdigest()[:32])
            break
    names = (context.auth_context() or {}).get("x509_common_name")
    if names:
        parts.append("peer:" + names[0].decode(errors="replace"))
    return "|".join(parts)


async def authorize_token(context, token: str) -> None:
    refusal = token_refusal(context.invocation_metadata(), token)
    if refusal is not None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)


# ---- the scheduler<->worker secret ---------------------------------------------------------------


def check_worker_secret(secret: str) -> None:
    """Raise ValueError for a secret too short to resist guessing ("" = none: allowed)."""
    if secret and len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"KVFLEET_WORKER_SECRET must be at least {MIN_SECRET_CHARS} characters (got {len(secret)}); "
            "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )


def secret_from_env(name: str, env: Mapping[str, str] | None = None) -> str:
    """The variable ``name``, or the contents of ``name``_FILE (surrounding whitespace dropped:
    files end in a newline; compose hands secrets over as files of a volume); "" when neither
    is set. ValueError when both are, or the file cannot be read or is empty."""
    env = os.environ if env is None else env
    file_var = f"{name}_FILE"
    value, path = env.get(name, ""), env.get(file_var, "")
    if value and path:
        raise ValueError(f"set {name} or {file_var}, not both")
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read {file_var} {path}: {exc.strerror}") from exc
        if not value:
            raise ValueError(f"{file_var} {path} is empty")
    return value


def worker_secret_from_env(env: Mapping[str, str] | None = None) -> str:
    """KVFLEET_WORKER_SECRET or KVFLEET_WORKER_SECRET_FILE (see secret_from_env), checked."""
    value = secret_from_env("KVFLEET_WORKER_SECRET", env)
    check_worker_secret(value)
    return value


def telemetry_token_from_env(env: Mapping[str, str] | None = None) -> str:
    """KVFLEET_TELEMETRY_TOKEN or KVFLEET_TELEMETRY_TOKEN_FILE (see secret_from_env)."""
    return secret_from_env("KVFLEET_TELEMETRY_TOKEN", env)


def worker_secret_metadata(secret: str) -> list[tuple[str, str]]:
    return [(WORKER_SECRET_HEADER, secret)] if secret else []


WORKER_SECRET_HOWTO = (
    f"send metadata '{WORKER_SECRET_HEADER}' with the worker's secret: give the scheduler and its "
    "workers the same KVFLEET_WORKER_SECRET (or KVFLEET_WORKER_SECRET_FILE)"
)


def worker_secret_refusal(metadata: Iterable[tuple[str, str | bytes]] | None, secret: str) -> str | None:
    """Why a call does not carry the worker's secret (None: it does, or none is configured).
    The message says how to configure it and nothing else (no ids, no state of the worker)."""
    if not secret:
        return None
    try:
        sent = single_metadata(metadata, WORKER_SECRET_HEADER)
    except DuplicateMetadata:
        return f"metadata '{WORKER_SECRET_HEADER}' sent more than once; send it exactly once"
    if sent is None:
        return f"this worker obeys only its scheduler; {WORKER_SECRET_HOWTO}"
    if not same_secret(sent, secret):
        return f"wrong worker secret; {WORKER_SECRET_HOWTO}"
    return None


class WorkerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Gates every method of one service (the Worker's): the TLS peer check, then the secret,
    both before the request is handled. Other services (health, reflection) stay open."""

    def __init__(self, service: str, tls: TlsConfig, secret: str) -> None:
        self._prefix = f"/{service}/"
        self._tls = tls
        self._secret = secret

    async def _check(self, context) -> None:
        await authorize_peer(context, self._tls)
        refusal = worker_secret_refusal(context.invocation_metadata(), self._secret)
        if refusal is not None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)

    async def intercept_service(self, continuation: Callable[[object], Awaitable], details) -> object:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        check = self._check
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def guarded(request, context):
                await check(context)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                guarded,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None and not inspect.isasyncgenfunction(handler.stream_stream):
            # (A handler that writes with context.write and returns; a generator's items would
            # need relaying here: refused below rather than served ungated.)
            streaming = handler.stream_stream

            async def guarded_stream(requests, context):
                await check(context)  # before the first request is read
                return await streaming(requests, context)

            return grpc.stream_stream_rpc_method_handler(
                guarded_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        # A unary-stream or stream-unary method added later must be gated here before it can be
        # called at all (fail closed, never open).
        raise TypeError(f"{details.method}: WorkerAuthInterceptor gates unary and bidirectional methods only")

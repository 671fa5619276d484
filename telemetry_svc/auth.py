"""Who may write to (and optionally read from) the telemetry service.

Writes decide experiments: Export feeds the timings, RecordArtifact the exactness and the
provenance. So when a bearer token and/or an allowed-clients list (mutual TLS) is configured,
every write must pass each configured check; reads must too when `protect_reads` is set.
Health and reflection are never gated (probes and grpcurl carry no token).

The token travels as gRPC metadata `authorization: Bearer <token>`; OTLP exporters send it with
the standard OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer <token>".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc

from kvfleet_common.security import DuplicateMetadata, peer_common_names, same_secret, single_metadata

WRITE_METHODS = frozenset({
    "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    "/kvfleet.v1.Telemetry/RecordArtifact",
})  # fmt: skip
READ_PREFIX = "/kvfleet.v1.Telemetry/"
GRPC_TOKEN_HINT = (
    "send metadata 'authorization: Bearer <token>' "
    "(OTLP exporters: OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer <token>)"
)


@dataclass(frozen=True)
class AuthPolicy:
    token: str = ""  # empty: no token check
    allowed_clients: frozenset[str] = field(default_factory=frozenset)  # client-certificate CNs
    protect_reads: bool = False

    def __post_init__(self) -> None:
        if self.protect_reads and not self.configured:
            raise ValueError("protecting reads needs a token or an allowed-clients list")

    @property
    def configured(self) -> bool:
        return bool(self.token or self.allowed_clients)

    def guards(self, method: str) -> bool:
        if not self.configured:
            return False
        return method in WRITE_METHODS or (self.protect_reads and method.startswith(READ_PREFIX))

    def refusal(
        self, metadata: Any, peer_names: set[str], token_hint: str = GRPC_TOKEN_HINT, action: str = "write"
    ) -> tuple[grpc.StatusCode, str] | None:
        """None when the caller passes every configured check, else the status to answer (the
        HTTP API maps it to 401 / 403, with its own hint on how to send the token)."""
        if self.token:
            try:
                sent = single_metadata(metadata, "authorization") or ""
            except DuplicateMetadata:
                return grpc.StatusCode.UNAUTHENTICATED, (
                    "more than one 'authorization' metadata entry; send exactly one 'authorization: Bearer <token>'"
                )
            # Constant-time compare: the check must not leak how much of a guess was right.
            if not same_secret(sent, f"Bearer {self.token}"):
                why = "wrong bearer token" if sent else "no bearer token"
                return grpc.StatusCode.UNAUTHENTICATED, f"{why}; {token_hint}"
        if self.allowed_clients and not (peer_names & self.allowed_clients):
            return grpc.StatusCode.PERMISSION_DENIED, (
                f"client certificate {sorted(peer_names) or 'none'} may not {action} here; "
                f"allowed: {sorted(self.allowed_clients)}"
            )
        return None


Refused = Callable[[str], None]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each guarded unary handler so the check runs before the request is handled (for
    Export, before its bytes are even parsed)."""

    def __init__(self, policy: AuthPolicy, on_refused: Refused = lambda method: None) -> None:
        self._policy = policy
        self._on_refused = on_refused

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or not self._policy.guards(details.method) or handler.unary_unary is None:
            return handler
        inner, policy, method, on_refused = handler.unary_unary, self._policy, details.method, self._on_refused
        action = "write" if method in WRITE_METHODS else "read"

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            refusal = policy.refusal(context.invocation_metadata(), peer_common_names(context), action=action)
            if refusal is not None:
                on_refused(method)
                await context.abort(*refusal)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(guarded, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)  # fmt: skip
